"""The README's NVIDIA FLARE block, extracted from the README and run as written in FLARE's environment (the main
suite's tests/test_readme.py runs every other block): the recipe with fastagg's aggregator exports a job whose
server workflow names FastaggAggregator with the block's rule and hyper-parameters."""
from __future__ import annotations

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_readme_flare_block_runs(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```$", readme, re.S | re.M) if "fastagg.nvflare" in b]
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    (tmp_path / "client.py").write_text("# the user's FLARE client script\n")
    exec(compile(blocks[0], "README.md", "exec"), {"__name__": "readme_block"})
    configs = list((tmp_path / "jobs").rglob("config_fed_server.json"))
    assert len(configs) == 1
    mine = json.loads(configs[0].read_text())["workflows"][0]["args"]["aggregator"]
    assert mine["path"] == "fastagg.nvflare.FastaggAggregator"
    assert mine["args"]["rule"] == "fedexp" and mine["args"]["hyper"] == {"eps": 1e-3}
