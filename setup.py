"""Packaging for infmem-verl. Dependencies live in requirements/*.txt; `make install` uses them."""

from setuptools import find_packages, setup

setup(
    name="infmem-verl",
    version="0.1.0",
    description="Bounded-memory agents (InfMem, MemAgent) for QA over ultra-long documents, trained with verl",
    python_requires=">=3.10,<3.13",
    license="Apache-2.0",  # LICENSE
    # The top-level conf/ (Hydra configs and recipes) ships inside the package as infmem_verl/conf
    # (see infmem_verl.conf_dir); a checkout reads it where it is.
    packages=[*find_packages(include=["infmem_verl", "infmem_verl.*", "data_prep", "data_prep.*"]), "infmem_verl.conf"],
    package_dir={"infmem_verl.conf": "conf"},
    package_data={"infmem_verl": ["viewer/assets/*"], "infmem_verl.conf": ["*.yaml", "**/*.yaml"]},
    install_requires=[
        "numpy",
        "scipy",
        "transformers>=5.5.3,<5.11,!=5.6.0",
        "hydra-core",
        "pyarrow",
        "rank-bm25",
        "PyStemmer",
    ],
    extras_require={
        "verl": ["verl[verl-core]==0.9.1", "ray"],
    },
    entry_points={"verl.plugins": ["infmem = infmem_verl.plugin"]},
)
