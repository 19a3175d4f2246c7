"""A fuzz of `python -m zoo`: Hypothesis draws command lines — overrides of every kind of key (top-level sizes,
groups and their options, part and task keys, Hydra's own), values of every type and range (huge and negative
integers, floats as 1e9, nan, inf, unicode text, quotes, interpolations, paths under a file or in /proc),
the `+`, `++` and `~` forms, sweeps (comma lists, range(), choice(), interval()) and Hydra's flags — and holds
every outcome to the CLI's contract: status 0, or status 2 with one line on stderr that starts with `zoo: `; never
a traceback; and for a refusal, nothing written under the working directory. Most cases run in this process
(tests/cli_harness.py: Hydra for real, the tasks replaced by a recorder); two run as real processes."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from cli_harness import zoo_in_process
from properties.catalog.sessions import Session, run_pytest
from zoo.config.options import options

ROOT = Path(__file__).resolve().parents[1]

TOP = ["d_model", "heads", "kv_heads", "layers", "d_ff", "vocab_size", "max_len", "dropout", "norm_placement",
       "device", "dtype", "seed", "reference", "allow_plugins"]
GROUPS = ["model", "attention", "ffn", "norm", "pos", "preset", "task", "data", "experiment", "recipe"]
NESTED = ["attention.window", "attention.softcap", "attention.kernel", "attention.kv_heads", "attention._target_",
          "attention.bias", "ffn.activation", "ffn.d_ff", "norm.eps", "pos.base", "model.final_norm",
          "model.decoder_layers", "model.layers", "model.tie_head", "model.type_vocab_size", "task.batch",
          "task.seq_len", "task.steps", "task.out_dir", "task.checkpoint", "task.profile", "task.verify",
          "task.prompt", "task.resume", "task.packing", "task.block_size", "task.temperature", "task.top_k",
          "task.d_model", "task.heads", "data.vocab", "data.max_len", "data.seed", "hydra.run.dir", "hydra.sweep.dir",
          "hydra.job.chdir", "hydra.verbose", "hydra.sweep.subdir", "hydra/launcher", "nosuch", "attention.nosuch"]
SPECIAL = ["null", "true", "false", "", "~", "'quoted'", '"dq"', "[1,2]", "{a: 1}", "${nosuch:x}", "${heads}",
           "${oc.env:ZOO_FUZZ_UNSET}", "${now:%H}", "a,b", "1,2", "range(1,3)", "choice(1,2)", "interval(0,1)",
           "glob(*)", "\\", "1e9", "1e999", "nan", "inf", "-inf", "0.5", "1.5", "-0.0", "2e-400", "0x10",
           "99999999999999999999999", "-99999999999999999999999", "1099511627776", "4097", "/proc", "/nonexistent/x",
           "FILE/x", "out", "out/${now:%S}", "math", "torch", "swiglu", "rotary", "alibi", "gpt2_small", "summary",
           "train", "generate", "compare", "verify", "copy", "sort", "cuda", "meta", "float16", "hf", "zoo.nn.Nope",
           "os:system", "train/tiny/decoder_only/copy"]
FLAGS = [["-m"], ["--multirun"], ["--cfg", "job"], ["--cfg", "all"], ["-c"], ["--info"], ["--info", "defaults"],
         ["-cn", "nosuch"], ["-cn", "config"], ["-cp", "/nonexistent"], ["-cd", "FILE"], ["-cd"], ["--resolve"],
         ["-p", "task"], ["--shell-completion"], ["-sc", "install=bash"], ["--experimental-rerun", "FILE"],
         ["--hydra-help"], ["-r"], ["--nosuch"], ["-x"]]

SIZES = ["1", "2", "4", "8", "16", "32", "64", "3", "0", "-1", "1e9", "4097", "1.5", "null", "abc"]
PATHS = ["out", "FILE/x", "/proc", "/nonexistent/x", "${nosuch:x}", "out/${now:%S}", "''", "FILE"]
PLAUSIBLE = {  # values a user might type for each key, good and bad
    **dict.fromkeys(["d_model", "heads", "kv_heads", "layers", "d_ff", "vocab_size", "max_len", "attention.window",
                     "attention.kv_heads", "ffn.d_ff", "model.decoder_layers", "model.layers",
                     "model.type_vocab_size", "task.batch", "task.seq_len", "task.steps", "task.block_size",
                     "task.top_k", "task.d_model", "task.heads", "data.vocab", "data.max_len", "seed",
                     "data.seed"], SIZES),
    **dict.fromkeys(["dropout", "attention.softcap", "norm.eps", "pos.base", "task.temperature"],
                    ["0", "0.1", "0.5", "1", "-0.1", "nan", "inf", "2.0", "1e-12"]),
    **dict.fromkeys(["allow_plugins", "attention.bias", "model.final_norm", "model.tie_head", "task.verify",
                     "task.resume", "task.packing", "hydra.job.chdir"], ["true", "false", "null", "abc", "1"]),
    **dict.fromkeys(["task.out_dir", "task.checkpoint", "hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir"],
                    PATHS),
    "norm_placement": ["pre", "post", "mid"], "device": ["cpu", "cuda", "cuda:7", "meta", "mps", "tpu"],
    "dtype": ["float32", "float64", "bfloat16", "float16", "int8"], "reference": ["hf", "torch", "abc", "null"],
    "attention.kernel": ["math", "torch", "memory_efficient", "os:system", "nope.py:f", "zoo.nn.kernel:math_attention"],
    "attention._target_": ["zoo.nn.attention.MultiHeadAttention", "nowhere.Attention",
                           "properties.catalog.modules.SplitHeadsWithoutTranspose"],
    "ffn.activation": ["relu", "gelu", "swiglu", "tanh"], "task.profile": ["quick", "default", "ci", "fast"],
    "task.prompt": ["'3 1 4'", "'x'", "''"], "hydra.verbose": ["true", "zoo"],
    "hydra.output_subdir": [".hydra", "null", "/proc/x"], "hydra.job_logging.root.level": ["INFO", "NOSUCH"],
    "hydra.sweeper.max_batch_size": ["null", "1", "0"], "hydra.job.name": ["zoo", "${nosuch:x}"],
    **{group: [*options(group), "nosuch", "null"] for group in GROUPS if group != "recipe"},
    "recipe": ["train/tiny/decoder_only/copy", "nosuch", "null"],
}
sweeps = st.builds(lambda key, values: f"{key}={','.join(values)}", st.sampled_from(sorted(PLAUSIBLE)),
                   st.lists(st.sampled_from(SIZES[:6] + ["abc", "nosuch"]), min_size=2, max_size=3))
plausible = st.sampled_from(sorted(PLAUSIBLE)).flatmap(
    lambda key: st.builds(lambda prefix, value: f"{prefix}{key}={value}", st.sampled_from(["", "", "", "+", "~"]),
                          st.sampled_from(PLAUSIBLE[key])))
wild_values = st.one_of(st.sampled_from(SPECIAL), st.integers().map(str), st.floats().map(repr), st.text(max_size=10),
                        st.sampled_from([2**31, 2**63, 2**64, -2**63 - 1, 10**25]).map(str))
wild_keys = st.one_of(st.sampled_from(TOP + GROUPS + NESTED), st.text(st.characters(codec="utf-8"), max_size=6))
wild = st.one_of(st.builds(lambda prefix, key, value: f"{prefix}{key}={value}",
                           st.sampled_from(["", "+", "++", "~"]), wild_keys, wild_values),
                 wild_keys.map(lambda key: f"~{key}"), st.text(max_size=8))
GOOD = {  # values that pass alone, so that a drawn command line often reaches Hydra's run (and its task)
    **dict.fromkeys(["d_model", "d_ff", "vocab_size", "max_len", "task.batch", "data.vocab"], ["16", "32", "64"]),
    **dict.fromkeys(["heads", "kv_heads", "layers", "seed", "attention.window"], ["1", "2"]),
    "dropout": ["0", "0.1"], "norm_placement": ["pre", "post"], "dtype": ["float32", "float64", "bfloat16"],
    "hydra.run.dir": ["out", "out/${now:%S}"], "hydra.sweep.dir": ["sweep"], "hydra.job.chdir": ["false"],
    **{group: list(options(group)) for group in ("model", "attention", "ffn", "norm", "pos", "task")},
}
good = st.sampled_from(sorted(GOOD)).flatmap(lambda key: st.sampled_from(GOOD[key]).map(lambda v: f"{key}={v}"))
words = st.one_of(plausible, plausible, sweeps, wild)
command_lines = st.one_of(
    st.builds(lambda flags, overrides: [w for f in flags for w in f] + overrides,
              st.lists(st.sampled_from(FLAGS), max_size=1), st.lists(words, max_size=4)),
    st.builds(lambda flag, overrides, last: flag + overrides + last, st.sampled_from([[], [], ["-m"], ["--cfg", "job"]]),
              st.lists(good, max_size=4), st.lists(words, max_size=1)))


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    return tmp_path_factory.mktemp("cli-fuzz")


def _check(argv: list[str], sandbox: Path) -> None:
    root = Path(tempfile.mkdtemp(dir=sandbox))
    work = root / "work"
    work.mkdir()
    (root / "a_file").write_text("a file where a directory should be\n")
    argv = [w.replace("FILE", str(root / "a_file")) for w in argv]
    # another launcher runs the jobs in other processes, where the tasks are not replaced: not in this process
    assume(not any("launcher" in w for w in argv))
    outcome = zoo_in_process(argv, work, watch=root)
    lines = [line for line in outcome.err.splitlines() if line.strip()]
    assert "Traceback" not in outcome.err, (argv, outcome.err[-3000:])
    assert outcome.status in (0, 2), (argv, outcome.status, outcome.err[-3000:])
    if outcome.status == 2:
        assert len(lines) == 1 and lines[0].startswith("zoo: "), (argv, outcome.err[-3000:])
        assert not outcome.written, (argv, outcome.written)


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@example(["layers=1e9"])
@example(["-m", "hydra.sweep.dir=FILE/x", "heads=1,2"])
@example(["hydra.run.dir=${nosuch:x}", "task=summary"])
@example(["--experimental-rerun", "FILE"])
@example(["+=5", "~attention", "task.out_dir=/proc", "task=train"])
@example(["seed=99999999999999999999999"])
@example(["-m", "model=nosuch,decoder_only"])
@example(["reference=abc", "task=summary"])
@example(["d_model=1099511627776"])
@example(["task=train", f"task.out_dir={'d' * 300}"])
@given(argv=command_lines)
def test_any_command_line_succeeds_or_is_one_line(sandbox, argv):
    _check(argv, sandbox)


@pytest.mark.parametrize("argv,words", [
    (["-m", "heads=3,abc", "task=summary"], ["heads="]),
    (["layers=1e9", "hydra.run.dir=${nosuch:x}"], ["layers=1000000000"]),
])
def test_a_real_process_refuses_in_one_line_and_writes_nothing(tmp_path, argv, words):
    """What only a real process shows: the command line as the shell passes it, Hydra's and Python's own
    handlers, the exit status the shell sees."""
    env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "zoo", *argv], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env=env)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("zoo: "), result.stderr[-3000:]
    assert all(word in lines[0] for word in words), lines[0]
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------- the project's other commands
# Every argparse command README and --help name, called in this process: a bad value is one line `PROG: error: ...`
# and exit status 2 before any work (zoo/cli/arguments.py), never a traceback, never accepted and ignored. Every value
# below is refused by argument checks alone, so each case costs milliseconds.
def _commands():
    from bench import gpu_check, profile, report
    from bench.run import parse_args as bench_args
    from properties.adapters import conformance
    from properties.catalog import example_based, flakiness, flash_example_based, mutation_report
    return {"python -m bench": bench_args, "python -m bench.gpu_check": gpu_check.main,
            "python -m bench.report": report.main, "python -m bench.profile": profile.main,
            "python -m properties.catalog.flakiness": flakiness.main,
            "python -m properties.catalog.mutation_report": mutation_report.main,
            "python -m properties.adapters.conformance": conformance.main,
            "python -m properties.catalog.example_based": example_based.main,
            "python -m properties.catalog.flash_example_based": flash_example_based.main}


LONG = "n" * 300
BAD_ARGUMENTS = {   # command -> option -> values it must refuse
    "python -m bench": {"--batch": ["-1", "0", "x"], "--threads": ["0", "-1"], "--prompt": ["0"],
                        "--decode-batch": ["-2"], "--device": ["nosuch", "cuda:7"], "--time-limit": ["nan", "-1", "inf"],
                        "--matmul-n": ["-5", "0"], "--layers": ["0"], "--new-tokens": ["-3"],
                        "--out": ["/proc/x.json", f"/tmp/{LONG}.json", "FILE/x.json"], "--lengths": ["0", "a"],
                        "--dtypes": ["float99"], "--parts": ["nosuch"], "--device ": ["meta"],
                        "--lengths ": ["99999999999", "4096"]},
    # the results file to render (positional): missing, a directory, not UTF-8, not JSON, not an object, no record
    "python -m bench.report": {"": ["/nonexistent.json", "/tmp", "BINARY", "FILE", "LIST_JSON", "EMPTY_JSON",
                                    "WRONG_JSON"], "--only": ["nosuch"]},
    "python -m bench.profile": {"--dtype": ["nope"], "--seq-len": ["0", "-1", "99999"], "--batch": ["0"],
                                "--threads": ["0"], "--calls": ["0"], "--rows": ["-1"], "--layers": ["0"],
                                "--device": ["nope", "meta"], "--family": ["nosuch"]},
    "python -m bench.gpu_check": {"--doc": ["/nonexistent/README.md", "FILE"], "--limit": ["200", "nan", "-1"],
                                  "--device": ["nosuch"], "--out": ["/proc/x.json", f"/tmp/{'o' * 250}.json"]},
    "python -m properties.catalog.flakiness": {"--seeds": ["0", "-1"], "-n": ["0", "-1"], "--json": ["/proc/x.json"],
                                               "--only": ["nosuch"]},
    "python -m properties.catalog.mutation_report": {"--jobs": ["0"], "--json": ["/proc/x.json", "FILE/x"],
                                                     "--only": ["nosuch"]},
    "python -m properties.adapters.conformance": {"--timeout": ["nan", "-5", "0", "1e300"], "--jobs": ["0"], "--long": ["-1"],
                                                  "--out": ["/proc/x"], "--factories": ["FILE", "/nonexistent.py"]},
    "python -m properties.catalog.example_based": {"--kernel": ["nosuch:fn", "os:getcwd", "nosuch"]},
    "python -m properties.catalog.flash_example_based": {"--device": ["nosuch"], "--kernel": ["nosuch:fn"]},
}
REQUIRED = {"python -m bench.gpu_check": ["--device", "cpu"],
            "python -m properties.catalog.flash_example_based": ["--kernel", "properties.catalog.flash_bugs:softcap_dropped"]}
CASES = [(cmd, opt, value) for cmd, options in BAD_ARGUMENTS.items() for opt, values in options.items() for value in values]


def _words(option: str, value: str) -> list[str]:
    """The words of one case: "" is a positional argument; "--device " a second key for the same option."""
    return [option.strip(), value] if option else [value]


FILES = {"FILE": "not a README with a GPU section, not Python, not JSON: (\n", "LIST_JSON": "[1, 2]\n",
         "EMPTY_JSON": "{}\n", "WRONG_JSON": '{"machine": 1, "settings": {}}\n'}


def _refused(command: str, argv: list[str], tmp_path: Path, capsys) -> str:
    for name, text in FILES.items():
        (tmp_path / name.lower()).write_text(text)
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00")
    for name in [*FILES, "BINARY"]:
        argv = [str(tmp_path / name.lower()) if w == name else w.replace(f"{name}/", f"{tmp_path / name.lower()}/")
                for w in argv]
    with pytest.raises(SystemExit) as done:
        _commands()[command](argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert done.value.code == 2 and len(lines) == 1 and lines[0].startswith(f"{command}: error: "), (argv, err)
    return lines[0]


@pytest.mark.parametrize("command,option,value", CASES, ids=[f"{c.split()[-1]} {o}={v[:20]}" for c, o, v in CASES])
def test_every_command_refuses_a_bad_argument_in_one_line(tmp_path, capsys, command, option, value):
    line = _refused(command, [*REQUIRED.get(command, []), *_words(option, value)], tmp_path, capsys)
    assert option.strip().lstrip("-") in line or "argument" in line, line


def test_bench_merge_refuses_a_results_file_that_is_not_an_object(tmp_path, capsys):
    line = _refused("python -m bench", ["--parts", "kernel", "--merge", "--out", "LIST_JSON"], tmp_path, capsys)
    assert "--merge" in line and "JSON list" in line, line


@settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(CASES), noise=st.lists(st.sampled_from(SPECIAL + SIZES), max_size=2))
def test_any_bad_argument_among_others_is_one_line(tmp_path, capsys, case, noise):
    """A bad value with stray words around it: still one line and 2, whatever argparse meets first."""
    command, option, value = case
    _refused(command, [*REQUIRED.get(command, []), *noise, *_words(option, value)], tmp_path, capsys)


def test_an_unknown_name_beside_a_known_one_is_refused(tmp_path, capsys):
    from properties.catalog.flakiness import SUBJECTS
    line = _refused("python -m properties.catalog.flakiness", ["--only", SUBJECTS[0].name, "--only", "nosuch"],
                    tmp_path, capsys)
    assert "nosuch" in line and SUBJECTS[0].name not in line.split("the subjects are")[0], line


def test_conformance_names_a_pytest_option_pytest_refuses(tmp_path, capsys):
    line = _refused("python -m properties.adapters.conformance",
                    ["--only", "gpt2", "--long", "0", "--out", str(tmp_path / "out"), "--", "--nosuch-option"],
                    tmp_path, capsys)
    assert "unrecognized arguments: --nosuch-option" in line, line
    assert not (tmp_path / "out").exists()


def test_example_based_fails_a_kernel_that_returns_a_tuple(tmp_path, capsys):
    from properties.catalog import example_based
    (tmp_path / "pair.py").write_text("import torch.nn.functional as F\n"
                                      "def attention(q, k, v, **kw):\n"
                                      "    return F.scaled_dot_product_attention(q, k, v, **kw), None\n")
    assert example_based.main(["--kernel", f"{tmp_path / 'pair.py'}:attention", "-x"]) == 1
    assert "returned tuple, not a tensor" in capsys.readouterr().out


# The suite's options added with the distributed level and the differential model clauses: each bad value, or an
# option that cannot apply, is refused before collection in one line (pytest's usage error, exit 4), and no rank is
# started for it.
SUITE_OPTIONS = {
    "--world-size x": "--world-size 'x': expected a whole number of ranks",
    "--world-size 0": "--world-size '0': expected a whole number of ranks",
    "--world-size 1.5": "expected a whole number of ranks",
    "--world-size 100000": "--world-size 100000: this machine holds at most",
    "--shard nosuch": "argument --shard: invalid choice: 'nosuch'",
    "--shard zigzag": "--shard: the distributed level's option, but no --world-size W is given",
    "--master-port 99999 --world-size 2": "--master-port '99999': expected a TCP port number",
    "--world-size 2 --kernel-api flash": "--kernel-api does not apply to them",
    "--world-size 2 --kernel NOSUCH_FILE.py:fn": "NOSUCH_FILE.py' does not exist",
    "--reference upstream": "--reference 'upstream': needs the model it is compared with",
    "--reference-map nosuch": "--reference-map",
}


def _suite_refusal(words: str, tmp_path: Path) -> Session:
    """``python -m pytest --pyargs properties WORDS`` in ``tmp_path`` (a session forked from a server that imported
    torch once, properties/catalog/sessions.py)."""
    return run_pytest(["--pyargs", "properties", "-q", "-p", "no:cacheprovider",
                       *words.replace("NOSUCH_FILE", str(tmp_path / "nosuch")).split()], cwd=tmp_path, timeout=120)


@pytest.mark.parametrize("words", list(SUITE_OPTIONS))
def test_a_bad_suite_option_is_refused_in_one_line(tmp_path, words):
    proc = _suite_refusal(words, tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ERROR: ")]
    assert proc.returncode == 4 and lines and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert SUITE_OPTIONS[words].replace("NOSUCH_FILE", str(tmp_path / "nosuch")) in proc.stderr, proc.stderr[-2000:]
