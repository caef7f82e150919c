"""The simulator against a hostile or careless run folder and command line: --resume never imports a model factory
that only the folder names, refuses what it cannot resume without touching the results, and reads a folder's
files without following links or blocking; settings (--mode async, --attack, --dp) are refused before anything is
written; deep settings files are one line; a zero-argument model factory works; --help and the README state the
defaults the parser has."""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
import uuid
from pathlib import Path

import pytest
import torch

from fastagg.sim import runner
from fastagg.sim import __main__ as cli
from fastagg.sim.__main__ import main, parser

DIGITS = ["--dataset", "digits", "--algorithm", "fedavg", "--participation", "0.25", "--local-steps", "1",
          "--batch-size", "8", "--eval-samples", "64"]


def _error(capsys, argv, text):
    """``main(argv)`` exits 2 with one line naming ``text``."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and text in err[0], err
    return err[0]


def _files(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


# -- item 1: --resume never imports code the folder alone names ------------------------------------------------------

def _planted(tmp_path, monkeypatch, capsys):
    """A user's run of their own zero-argument factory (BatchNorm without running statistics) in a shared runs/
    folder, 2 rounds; returns (its module name, the folder)."""
    monkeypatch.chdir(tmp_path)
    mine = f"mynet_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mine}.py").write_text(
        "import torch\n"
        "def net():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.BatchNorm1d(16, "
        "track_running_stats=False), torch.nn.ReLU(), torch.nn.Linear(16, 10))\n")
    out = tmp_path / "runs" / "a"
    assert main([*DIGITS, "--model", f"{mine}:net", "--rounds", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    return mine, out


def test_resume_never_imports_a_factory_named_only_by_the_run_folder(tmp_path, monkeypatch, capsys):
    """An attacker who can write into runs/ names a module of theirs in config.json (a package under the current
    directory, which the import path starts with): resuming used to import it, running it as the owner."""
    mine, out = _planted(tmp_path, monkeypatch, capsys)
    # the owner's own factory: refused until named again, then the run extends
    _error(capsys, ["--resume", "--out", str(out), "--rounds", "3"], f"pass --model {mine}:net beside --resume")
    assert main(["--resume", "--out", str(out), "--rounds", "3", "--model", f"{mine}:net"]) == 0
    capsys.readouterr()
    evil = f"evil_{uuid.uuid4().hex[:8]}"
    (out / f"{evil}.py").write_text(f"open({str(tmp_path / 'PWNED')!r}, 'w').write('ran')\n"
                                    "def f(data=None):\n    raise SystemExit(0)\n")
    config = json.loads((out / "config.json").read_text())
    config["model"] = f"runs.a.{evil}:f"
    (out / "config.json").write_text(json.dumps(config))
    before = _files(out)
    _error(capsys, ["--resume", "--out", str(out), "--rounds", "4"], f"names the model factory 'runs.a.{evil}:f'")
    with pytest.raises(ValueError, match="would import and run that code"):  # the Python API alike
        runner.run(runner.Config(out=str(out), rounds=4), resume=True)
    assert not (tmp_path / "PWNED").exists() and f"runs.a.{evil}" not in sys.modules
    assert _files(out) == before


def test_the_folder_is_checked_before_a_named_factory_is_imported(tmp_path, monkeypatch, capsys):
    """Even with the factory named, a folder with nothing to resume is refused before the import."""
    mine, out = _planted(tmp_path, monkeypatch, capsys)
    spy = f"spy_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{spy}.py").write_text(f"open({str(tmp_path / 'IMPORTED')!r}, 'w').write('x')\n"
                                        f"from {mine} import net\n")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model": f"{spy}:net"}))
    before = _files(out)
    # the checkpoint belongs to the mynet run: refused (another run's), before spy is imported
    _error(capsys, ["--resume", "--out", str(out), "--rounds", "3", "--model", f"{spy}:net"], "belongs to another run")
    assert not (tmp_path / "IMPORTED").exists() and _files(out) == before


# -- items 2, 3: settings refused before the folder is created --------------------------------------------------------

@pytest.mark.parametrize("flags, text", [
    (["--mode", "async"], "--mode async needs --client-time"),
    (["--attack", "label-flip", "--malicious", "0.2", "--dataset", "quadratic"], "label-flip needs a classification"),
    (["--attack", "sign-flip", "--malicious", "0.02"], "makes no attacker (round(0.02 x 20) = 0)"),
    (["--attack-scale", "5"], "there is no --attack"),
    (["--attack", "label-flip", "--malicious", "0.2", "--attack-scale", "5"], "label-flip has none"),
    (["--dp", "server-fixed:clip=1,z=1,seed=-1"], "seed must be an integer in [0, 2^64), got -1"),
    (["--dp", f"server-fixed:clip=1,z=1,seed={1 << 64}"], f"got {1 << 64}"),
    (["--dp", "server-fixed:clip=1,z=1,seed=1,seed=2"], "seed is given twice"),
    # review 4: each of these was accepted, or refused only after config.json and metrics.csv were written
    (["--dp", "server-fixed:clip=1,z=1e-300"], "z must be 0 (no noise) or at least 0.001, got 1e-300"),
    (["--dp", "server-fixed:clip=1,z=0.0009"], "z must be 0 (no noise) or at least 0.001"),
    (["--dp", "server-fixed:clip=1.0"], "z must be given"),
    (["--dp", "client-adaptive:z=1"], "clip must be given"),
    (["--mode", "async", "--client-time", "exponential:mean=1", "--max-staleness", "-1"],
     "max_staleness must be an integer >= 0"),
    (["--mode", "async", "--client-time", "exponential:mean=1", "--staleness", "hinge:1"], "takes hinge:a,b"),
    (["--mode", "async", "--client-time", "exponential:mean=1", "--staleness", "polynomial"], "takes polynomial:a"),
    (["--mode", "async", "--client-time", "exponential:mean=1", "--staleness", "hinge:-1,2"], "a must be"),
    (["--mode", "async", "--client-time", "exponential:mean=1", "--buffer-size", "1000"],
     "buffer_size 1000 exceeds the 5 clients training at once"),
    (["--mode", "async", "--client-time", "exponential:mean=1", "--concurrency", "1000"],
     "concurrency 1000 exceeds the 20 clients"),
    (["--seeds", "0,0"], "seeds given twice: 0"),
])
def test_bad_settings_are_refused_before_the_folder_is_created(tmp_path, capsys, flags, text):
    out = tmp_path / "run"
    _error(capsys, [*DIGITS, "--rounds", "1", *flags, "--out", str(out)], text)
    assert not out.exists()


def test_dp_seeds_at_the_ends_of_the_range_are_used_as_given():
    from fastagg.sim import privacy

    for seed in (0, (1 << 64) - 1):
        spec = privacy.parse(f"server-fixed:clip=1,z=1,seed={seed}")
        mech, _ = privacy.make(spec, participants=2, clients=4, run_seed=3)
        assert spec.seed == seed and mech.state_dict()["seed"] == seed


def test_async_mode_with_a_clock_runs(tmp_path, capsys):
    assert main([*DIGITS, "--rounds", "2", "--mode", "async", "--client-time", "exponential:mean=1"]) == 0


# -- item 5: what is not resumable is refused, and the results are never rewritten ------------------------------------

def test_a_finished_async_run_is_refused_and_its_metrics_kept(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*DIGITS, "--rounds", "3", "--mode", "async", "--client-time", "exponential:mean=1",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    lines = (out / "metrics.csv").read_text().splitlines()
    assert len(lines) == 1 + 4
    # the checkpoint counts the rows the async run wrote (it counted none: a resume truncated metrics.csv to them)
    assert torch.load(out / "checkpoint.pt", weights_only=True)["rows_written"] == 4
    before = _files(out)
    for extra in ([], ["--rounds", "5"]):
        _error(capsys, ["--resume", "--out", str(out), *extra], "asynchronous run")
        assert _files(out) == before


def test_a_finished_sync_run_is_refused_unless_extended(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*DIGITS, "--rounds", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    before = _files(out)
    for extra in ([], ["--rounds", "2"]):
        _error(capsys, ["--resume", "--out", str(out), *extra], "nothing to resume: every algorithm and seed")
        assert _files(out) == before
    assert main(["--resume", "--out", str(out), "--rounds", "3"]) == 0  # a larger --rounds extends it
    assert len((out / "metrics.csv").read_text().splitlines()) == 1 + 4


# -- a run folder's files are read without following links or blocking ------------------------------------------------

@pytest.mark.parametrize("name", ["config.json", "checkpoint.pt", "metrics.csv"])
def test_a_fifo_planted_in_the_folder_is_refused_not_waited_on(tmp_path, capsys, name):
    out = tmp_path / "run"
    assert main([*DIGITS, "--rounds", "1", "--out", str(out)]) == 0
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    ckpt["done"] = []  # make it resumable
    torch.save(ckpt, out / "checkpoint.pt")
    capsys.readouterr()
    os.unlink(out / name)
    os.mkfifo(out / name)
    _error(capsys, ["--resume", "--out", str(out)], "not a regular file")


def test_a_final_state_name_out_of_the_folder_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*DIGITS, "--rounds", "1", "--out", str(out)]) == 0
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    victim = tmp_path / "elsewhere.pt"
    os.replace(out / ckpt["finals"][0][2], victim)
    ckpt["finals"][0][2] = str(victim)
    torch.save(ckpt, out / "checkpoint.pt")
    capsys.readouterr()
    _error(capsys, ["--resume", "--out", str(out), "--rounds", "2"], "expected final-A-S.pt")


# -- item 6: deep settings files --------------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix, text", [
    (".json", '{"lr": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    (".yaml", "lr: " + "[" * 100_000 + "]" * 100_000 + "\n"),
    (".toml", "lr = " + "[" * 100_000 + "]" * 100_000 + "\n"),
])
def test_a_config_nested_100000_deep_is_one_line(tmp_path, capsys, suffix, text):
    path = tmp_path / f"deep{suffix}"
    path.write_text(text)
    _error(capsys, ["--config", str(path)], "nested too deeply")


def test_settings_nested_or_multiplied_past_the_limits_are_one_line(tmp_path, capsys):
    mid = tmp_path / "mid.json"
    mid.write_text('{"lr": ' + "[" * 9 + "]" * 9 + "}")
    _error(capsys, ["--config", str(mid)], "nested more than 8 levels deep")
    ok = tmp_path / "ok.json"  # 8 levels: the type check speaks, not the depth check
    ok.write_text('{"lr": ' + "[" * 7 + "]" * 7 + "}")
    _error(capsys, ["--config", str(ok)], "lr must be float")
    import yaml  # a test requirement ([test]): a missing one fails, never skips
    laughs = tmp_path / "laughs.yaml"  # aliases: 10^6 values from a few lines, 6 levels deep
    laughs.write_text("a: &a [1,1,1,1,1,1,1,1,1,1]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(5)))
    assert yaml.safe_load(laughs.read_text())["f"][0][0][0][0][0][0] == 1
    _error(capsys, ["--config", str(laughs)], "holds more than 100,000 values")


def test_a_run_folders_deep_config_json_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text('{"lr": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _error(capsys, ["--resume", "--out", str(out)], "nested too deeply")
    (out / "config.json").write_text('{"lr": ' + "[" * 50 + "]" * 50 + "}")
    _error(capsys, ["--resume", "--out", str(out)], "nested more than 8 levels deep")


# -- item 4: a factory without arguments ------------------------------------------------------------------------------

def test_a_zero_argument_factory_builds_the_model_seeded_by_the_run(tmp_path, monkeypatch):
    from fastagg.sim import data as datasets, models

    def net():  # what one writes first; BatchNorm without running statistics is allowed
        return torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.BatchNorm1d(8, track_running_stats=False),
                                   torch.nn.ReLU(), torch.nn.Linear(8, 10))

    class Net(torch.nn.Module):  # a class as the factory: its constructor takes nothing either
        def __init__(self):
            super().__init__()
            self.body = net()

        def forward(self, x):
            return self.body(x)

    d = datasets.load("digits")
    for name, factory in (("zero-arg", net), ("a-class", Net), ("with-data", lambda data: net())):
        models.register_model(name, factory)
        try:
            for seed in (0, 5):
                model = models.make(name, d, seed=seed)
                torch.manual_seed(seed)  # the oracle: the same module built under the run's seed
                expected = torch.cat([p.detach().flatten() for p in factory(*([d] if name == "with-data" else []))
                                      .parameters()])
                assert torch.equal(model.init(torch.float32, "cpu"), expected.float()), (name, seed)
        finally:
            models._USER_MODELS.pop(name)
    monkeypatch.chdir(tmp_path)
    mod = f"zeroarg_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}.py").write_text("import torch\ndef net():\n    return torch.nn.Sequential("
                                        "torch.nn.Linear(64, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), "
                                        "torch.nn.Linear(16, 10))\n")
    with pytest.raises(ValueError, match=r"layer '1' \(BatchNorm1d\) keeps running statistics"):
        models.make(f"{mod}:net", d)  # a BatchNorm with running statistics is still refused, naming the layer


# -- item 7: the documented defaults are the parser's -----------------------------------------------------------------

def _documented_default(action) -> str | None:
    from fastagg.sim.__main__ import _Help

    text = " ".join(_Help("fastagg-sim")._expand_help(action).split())
    m = re.search(r"default: (.*?)\)?$", text) or re.search(r"default: ([^;)]*)", text)
    return m.group(1) if m else None


def test_help_states_each_options_real_default():
    """Every option's "(default: X)" in --help: the parser's value; "none" only where the option is off unless
    given; "the data set's" only for the settings the data sets' paper table decides."""
    from fastagg.sim import data as datasets

    p = parser()
    checked = 0
    for action in p._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction,
                                                            argparse._StoreFalseAction)):
            continue
        shown = _documented_default(action)
        assert shown is not None, f"{action.option_strings[0]}: --help states no default"
        checked += 1
        if action.default is not None:
            assert shown == str(action.default), (action.option_strings[0], shown, action.default)
        elif shown.startswith("the data set's"):
            assert action.dest in cli.DATASET_DEFAULTS, action.option_strings[0]
        elif shown.startswith("none") or shown.startswith("no "):
            # off unless given: a default run resolves it to None (no column, no mechanism, no clock)
            cfg = runner.Config().resolved(datasets.load("quadratic"))
            field = {"out": "out", "config": None}.get(action.dest, action.dest)
            if field is not None and hasattr(cfg, field):
                assert getattr(cfg, field) is None, (action.option_strings[0], getattr(cfg, field))
    assert checked > 50
    shown = {a.dest: _documented_default(a) for a in p._actions}
    assert shown["dp"] == "none" and shown["compress"] == "none" and shown["client_time"] == "none"
    assert shown["config"] == "none"
    assert runner.metric_fields(runner.Config()) == runner.METRIC_FIELDS  # no epsilon, bytes_sent, virtual_time
    # the defaults stated in words, against the code that applies them
    for loader in (datasets.digits, datasets.digits_noisy, datasets.from_npz):
        assert inspect.signature(loader).parameters["alpha"].default == float(shown["dirichlet"])
    assert f"up to {runner.EVAL_SAMPLES}" in shown["eval_samples"]
    text = " ".join(p.format_help().split())
    assert "JSON, TOML (.toml) or YAML" in text and "seeded by the run's seed" in text
    assert "seeded 0" not in text and "JSON or TOML file" not in text


def test_readme_simulator_section_states_the_parsers_defaults():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("### Simulator", 1)[1].split("\n### ", 1)[0]
    flat = " ".join(section.split())
    p = parser()
    defaults = {a.option_strings[0]: a.default for a in p._actions if a.option_strings}
    stated = re.findall(r"`(--[a-z-]+)`\)? defaults to ([0-9.]+)", flat)
    assert stated, "the README states no flag's default"
    for flag, value in stated:
        assert float(value) == float(defaults[flag]), (flag, value, defaults[flag])
    for flag in ("--dp", "--compress", "--client-time"):  # off unless given, as the README describes them
        assert defaults[flag] is None
    assert "JSON" in flat and "YAML" in flat and "seeded by the run's seed" in flat
    assert f"up to {runner.EVAL_SAMPLES:,}" in flat


@pytest.mark.parametrize("kw", [dict(compress="int8"), dict(algorithms=("fedmedian",))])
def test_one_process_settings_are_refused_under_torchrun_before_the_folder_is_claimed(tmp_path, monkeypatch, kw):
    """Under torchrun, --compress / --dp / attacks / robust rules used to be refused by each rank's first run, after
    config.json and metrics.csv were written."""
    monkeypatch.setattr(runner, "join_ranks", lambda: (None, 0, 2))  # as if rank 0 of 2
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="run on one process for now"):
        runner.run(runner.Config(**{"dataset": "digits", "algorithms": ("fedavg",), "rounds": 1, **kw},
                                 out=str(out)))
    assert not out.exists()


# -- review 4: a saved state belongs to one run; a refused run leaves the folder as it was -----------------------------

@pytest.mark.parametrize("theirs, setting", [
    (["--lr", "0.2"], "it was saved with lr=0.2; "),
    (["--attack", "scale", "--malicious", "0.2"], "it was saved with attack='scale'; "),
    (["--dp", "server-fixed:clip=1.0,z=1.0,seed=7"], "it was saved with dp='server-fixed:clip=1.0,z=1.0,seed=7'; "),
])
def test_another_runs_saved_state_is_refused_on_resume(tmp_path, capsys, theirs, setting):
    """Two runs differing in a hyperparameter only: B's final state (or checkpoint) copied into A's folder is
    refused naming the setting (it was continued as A's: A's metrics.csv held B's trajectory), the folder
    byte-identical."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main([*DIGITS, "--rounds", "2", "--lr", "0.05", "--out", str(a)]) == 0
    assert main([*DIGITS, "--rounds", "2", "--lr", "0.05", *theirs, "--out", str(b)]) == 0
    capsys.readouterr()
    for name in ("final-0-0.pt", "checkpoint.pt"):
        mine = (a / name).read_bytes()
        (a / name).write_bytes((b / name).read_bytes())
        before = _files(a)
        _error(capsys, ["--resume", "--out", str(a), "--rounds", "3"], f"{name}' belongs to another run: {setting}")
        assert _files(a) == before
        (a / name).write_bytes(mine)
    assert main(["--resume", "--out", str(a), "--rounds", "3"]) == 0  # its own state: extended


def test_a_legacy_signed_folder_resumes_and_an_unsigned_final_state_does_not(tmp_path, capsys):
    """A checkpoint signed before every setting was (its "run" holds the 7 legacy keys; its final states carry
    none) is resumed with a warning; in a folder signed whole, a final state without a signature is refused."""
    out = tmp_path / "run"
    assert main([*DIGITS, "--rounds", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    final = torch.load(out / "final-0-0.pt", weights_only=True)
    assert final["run"]["settings"]["lr"] == json.loads((out / "config.json").read_text())["lr"]
    del final["run"]
    torch.save(final, out / "final-0-0.pt")
    before = _files(out)
    _error(capsys, ["--resume", "--out", str(out), "--rounds", "3"], "final-0-0.pt' belongs to another run: it "
           "carries no signature")
    assert _files(out) == before
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    saved = json.loads((out / "config.json").read_text())
    ckpt["run"] = {k: saved[k] for k in runner.outdir.LEGACY_SIGNATURE}
    torch.save(ckpt, out / "checkpoint.pt")
    with pytest.warns(UserWarning, match="saved before checkpoints recorded every setting"):
        assert main(["--resume", "--out", str(out), "--rounds", "3"]) == 0
    assert torch.load(out / "checkpoint.pt", weights_only=True)["run"] == runner.outdir.signature(
        runner.Config(**{**runner.saved_config(str(out)), "out": str(out)}))  # signed whole from now on


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_refused_in_its_first_round_leaves_the_folder_as_it_was(tmp_path, capsys, monkeypatch, resume):
    """--overwrite (or --resume) then an error at the first evaluation (as dp-accounting's ZeroDivisionError
    was): config.json and metrics.csv were replaced before it, the old run's checkpoint left beside them."""
    out = tmp_path / "run"
    assert main([*DIGITS, "--rounds", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    before = _files(out)

    def refused(*args, **kwargs):
        raise ValueError("refused at the first evaluation")

    monkeypatch.setattr(runner, "_evaluate", refused)
    argv = ["--resume", "--out", str(out), "--rounds", "3"] if resume else \
        [*DIGITS, "--rounds", "3", "--lr", "0.01", "--overwrite", "--out", str(out)]
    _error(capsys, argv, "refused at the first evaluation")
    assert _files(out) == before


def test_a_config_file_with_a_key_given_twice_is_refused(tmp_path, capsys):
    dup = tmp_path / "dup.json"
    dup.write_text('{"dataset": "digits", "rounds": 2, "rounds": 3}')
    _error(capsys, ["--config", str(dup), "--out", str(tmp_path / "run")], "the key 'rounds' is given twice")
    dup = tmp_path / "dup.yaml"
    dup.write_text("dataset: digits\nrounds: 2\nrounds: 3\n")
    _error(capsys, ["--config", str(dup), "--out", str(tmp_path / "run")], "the key 'rounds' is given twice")
    assert not (tmp_path / "run").exists()
