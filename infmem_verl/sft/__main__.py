"""``python -m infmem_verl.sft``: see :mod:`infmem_verl.sft.launch`."""

import sys

from infmem_verl.cli import take_traceback_flag
from infmem_verl.sft.launch import main

take_traceback_flag(sys.argv)
main()
