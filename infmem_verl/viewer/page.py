"""The viewer's HTML page: one self-contained file (styles, script and data inline), opened from disk.

No server and no network: a Content-Security-Policy forbids every fetch, so the page cannot
depend on one by accident. The data sits in ``application/json`` script tags, which the browser
stores without parsing: the index (``runs``) is parsed at load, a sample's turns (``detail-N``)
when it is opened, a chunk's text (``chunk-HASH-I``) when it is asked for. A
page holding a 1M-token document therefore opens as fast as one without, and each text is in the
file once, however many runs and turns refer to it.
"""

from __future__ import annotations

import dataclasses
import html
import json
from importlib import resources
from typing import Any

from .load import Runs

_CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"


def _json_tag(tag_id: str, value: Any) -> str:
    # "<" only occurs inside JSON strings, where \u003c means the same; so "</script>" in a text
    # cannot end the tag early.
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    return f'<script type="application/json" id="{html.escape(tag_id)}">{text}</script>'


def _asset(name: str) -> str:
    return resources.files("infmem_verl.viewer").joinpath("assets", name).read_text(encoding="utf-8")


def render(runs: Runs, title: str) -> str:
    """The page showing ``runs``."""
    index = {"runs": [dataclasses.asdict(run) for run in runs.runs]}
    data = [_json_tag("runs", index)]
    data += [_json_tag(f"detail-{i}", detail) for i, detail in enumerate(runs.details)]
    for digest, doc in runs.documents.items():
        if "missing" in doc:
            data.append(_json_tag(f"doc-{digest}", doc))
        else:  # one tag per chunk: showing a chunk parses that chunk, not the whole document
            data += [_json_tag(f"chunk-{digest}-{i}", text) for i, text in enumerate(doc["chunks"])]
    # "</" would end the script tag early; in JavaScript strings and regexes "<\/" means the same.
    script = _asset("viewer.js").replace("</", "<\\/")
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_CSP}">
<link rel="icon" href="data:,">
<title>{html.escape(title)}</title>
<style>{_asset("viewer.css")}</style>
</head>
<body>
<header>
<h1>{html.escape(title)}</h1>
<label>Run <select id="run-a"></select></label>
<label>compare with <select id="run-b"><option value="-1">(none)</option></select></label>
</header>
<div class="controls">
<input type="search" id="f-text" placeholder="filter: id, question, gold, prediction">
<label>correct <select id="f-correct"><option value="">any</option><option value="yes">yes</option><option value="no">no</option></select></label>
<label>stopped early <select id="f-stopped"><option value="">any</option><option value="yes">yes</option><option value="no">no</option></select></label>
<label>flag <select id="f-flag"></select></label>
<label>status <select id="f-status"><option value="">any</option><option value="ok">ok</option><option value="failed">failed</option></select></label>
<label>A vs B <select id="f-compare"><option value="">any</option><option value="differ">correctness differs</option><option value="a-only">only A correct</option><option value="b-only">only B correct</option></select></label>
<span id="count"></span>
</div>
<div id="index-wrap"><table id="index"><thead><tr></tr></thead><tbody></tbody></table></div>
<div id="detail" class="one"><p class="note">Click a sample to see its trajectory.</p></div>
{chr(10).join(data)}
<script>{script}</script>
</body>
</html>
"""
