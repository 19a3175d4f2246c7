"""--repro-dir (SPEC.md "Reproducers"): a catalog bug's reproducer exits 1 and, pointed at the correct twin, 0, for a
kernel clause (compared with another call, and with the oracle), a gradient clause, a statistical clause and a model
clause; the script imports nothing of the suite; --junitxml and --report-json carry the failure, the coverage and
the script's path."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

from properties.catalog import Entry
from properties.catalog.run import run_entry

_LEAKY = '''
import math
import torch


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """{doc}"""
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query.float() * scale) @ key.float().transpose(-1, -2)
    if is_causal:
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = {masking}
    elif attn_mask is not None:
        scores = scores + attn_mask.float()
    return (scores.softmax(-1) @ value.float()).to(query.dtype)
'''


def _run(tmp_path, option, spec, clauses, *extra):
    out = tmp_path / "repro"
    level = {"--model": "model", "--zoo": "module"}.get(option, "kernel")   # module: the module and model clauses
    run = run_entry(Entry(spec, level, spec, ("X",), option, spec,
                          ("--repro-dir", str(out), "--device", "cpu", *extra)),
                    clauses=clauses, seed=0, extra=("--hypothesis-profile", "pinned"))
    assert run.returncode == 1, run.output[-3000:]
    runs = sorted(out.iterdir())   # each run writes into a fresh subdirectory of its own
    assert len(runs) == 1 and runs[0].name.startswith("run-"), runs
    return run, runs[0]


def _script(out, clause):
    path = out / f"{clause}-1.py"
    assert path.is_file() and (out / f"{clause}-1.pt").is_file(), sorted(p.name for p in out.iterdir())
    text = path.read_text()
    imports = [line for line in text.splitlines() if line.startswith(("import ", "from "))]
    assert not [line for line in imports if "properties" in line], imports   # torch and the subject's module only
    return path


def _execute(path, *subject):
    """The script in a fresh isolated interpreter (-I: no PYTHONPATH, no script directory, no user site), run from the
    file system's root: a script finds its subject from any directory."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run([sys.executable, "-I", str(path), *subject], capture_output=True, text=True, env=env,
                          cwd="/", timeout=300)


def test_kernel_reproducers_run_without_the_suite(tmp_path):
    """A user's kernel file: the reproducers of a comparison of two calls (MASK-NO-INFLUENCE) and of one against the
    oracle (MASK-FULLY-MASKED) exit 1 where `properties` cannot be imported, and 0 on the fixed file."""
    (tmp_path / "leaky.py").write_text(textwrap.dedent(_LEAKY.format(
        doc="BERT's extended mask: -1e4 added to masked scores, so a masked key with a huge score keeps its weight",
        masking="scores + (~attn_mask).float() * -1e4")))
    (tmp_path / "fixed.py").write_text(textwrap.dedent(_LEAKY.format(
        doc="masked scores set to -inf; a query without an admissible key outputs 0",
        masking="scores.masked_fill(~attn_mask, -math.inf)")).replace(
        "return (scores.softmax(-1)", "return (scores.softmax(-1).nan_to_num(0.0)"))
    run, out = _run(tmp_path, "--kernel", f"{tmp_path}/leaky.py:attention", ("MASK-NO-INFLUENCE", "MASK-FULLY-MASKED"))
    paths = [str(_script(out, clause)) for clause in ("MASK-NO-INFLUENCE", "MASK-FULLY-MASKED")]
    assert _exit_codes(tmp_path, [[p] for p in paths] + [[p, f"{tmp_path}/fixed.py:attention"] for p in paths]) == [
        1, 1, 0, 0]
    rows = [r for r in run.rows if r["status"] == "failed"]
    assert rows and all(r["repro"] and r["repro"].startswith(str(out)) for r in rows), rows   # --report-json links


@pytest.mark.parametrize("option, spec, clause, twin", [
    ("--kernel", "properties.catalog.backward:dq_unscaled", "ATTN-GRAD", "properties.catalog.backward:straightforward"),
    ("--kernel", "properties.catalog.kernels:dropout_mask_shared", "DROPOUT-RATE", "math"),
    ("--model", "properties.catalog.models:no_causal_mask", "MODEL-CAUSAL", "{tmp}/fixed_model.py:decoder"),
    ("--kernel-api=flash", "--kernel=properties.catalog.flash_bugs:backward_without_window", "FLASH-GRAD",
     "properties.catalog.flash_bugs:flash_base"),   # FlashAttention's API: its float64 oracle inline, differentiated
], ids=["gradient", "statistical", "model", "flash-gradient"])
def test_catalog_reproducer_fails_and_its_twin_passes(tmp_path, option, spec, clause, twin):
    (tmp_path / "fixed_model.py").write_text("from properties.catalog.models import _factory\n"
                                             "from zoo.nn.models import DecoderOnly\n"
                                             "decoder = _factory(DecoderOnly)\n")
    junit = tmp_path / "junit.xml"
    _, out = _run(tmp_path, option, spec, (clause,), "--junitxml", str(junit))
    path = _script(out, clause)
    (code, stdout, stderr), fixed = _run_scripts("/", [[path], [path, twin.format(tmp=tmp_path)]], block_suite=False)
    assert code == 1 and stdout.startswith(f"FAIL {clause}:"), stdout + stderr
    assert fixed[0] == 0 and fixed[1].startswith(f"OK {clause}"), fixed[1] + fixed[2]
    # --junitxml: the failing test case carries its clause, the failure message, the script (and a kernel's coverage)
    case = next(c for c in ET.parse(junit).iter("testcase") if c.find("failure") is not None)
    properties = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert properties["clauses"] == clause and properties["repro"] == str(path), properties
    assert properties["failure"] and properties["failure"][:60] in case.find("failure").get("message"), properties
    if option == "--kernel":
        assert json.loads(properties["coverage"])["run"] >= 1, properties


_CONTRACT_BUGS = '''
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa


def correct(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa)


def raises_on_causal(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if is_causal:
        raise IndexError("the causal path indexes one key past the end")
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def drops_last_query(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    out = correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return out[..., :-1, :] if attn_mask is not None else out


def not_normalised(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) * 1.01


def dropout_not_rescaled(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
    return correct(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) * (1 - dropout_p)
'''

_DRIVER = '''import contextlib, io, json, runpy, sys, traceback
sys.modules["properties"] = None   # the scripts need torch and the subject's module only
results, blocked = [], int(sys.argv[2])
for n, (path, *subject) in enumerate(json.loads(sys.argv[1])):
    if n == blocked:   # the jobs after the first `blocked` load a subject of the catalog (properties.catalog)
        sys.modules.pop("properties", None)
    sys.argv = [path, *subject]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
            code = 0
        except SystemExit as exit_:
            code = exit_.code
        except BaseException:   # a script that breaks: its traceback, as an interpreter would print it
            traceback.print_exc()
            code = 1
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
'''


# The kinds of properties/repro/kernel_bodies.py, each told by a line of its script.
_KERNEL_KINDS = {"ATTN-SHIFT-INVARIANT": "softmax is unchanged by a constant", "ATTN-GRAD-GQA": "key_value_gradients",
                 "DROPOUT-INDEPENDENT": "p^2 + (1 - p)^2", "ATTN-OUTPUT-FRESH": "check_unchanged"}


def test_contract_fallback_and_statistical_reproducers(tmp_path):
    """One session, broken kernels: a raise, a wrong output shape (the calling contract), a clause whose own
    comparison records nothing (ATTN-ROWSUM: the last call against the oracle), DROPOUT-EXPECTATION, and catalog
    bugs whose reproducers rebuild a relation the last call does not show (ATTN-SHIFT-INVARIANT, ATTN-GRAD-GQA's
    group sum, DROPOUT-INDEPENDENT's pairs, ATTN-OUTPUT-FRESH's second call on the same tensors); every failure
    leaves a script that exits 1, and 0 on the correct kernel, in one isolated interpreter."""
    (tmp_path / "bugs.py").write_text(_CONTRACT_BUGS)
    bugs = [f"{tmp_path}/bugs.py:{name}" for name in ("raises_on_causal", "drops_last_query", "not_normalised",
                                                      "dropout_not_rescaled")] + [
        "properties.catalog.backward:gqa_kv_gradient_not_summed",
        "properties.catalog.kernels:dropout_mask_shared_across_heads",
        "properties.catalog.integrity_bugs:output_memoized_by_address"]
    kernels = [word for spec in bugs[1:] for word in ("--kernel", spec)]
    run, out = _run(tmp_path, "--kernel", bugs[0], ("CAUSAL-ZERO-ABOVE", "MASK-BOOL", "ATTN-ROWSUM",
                                                    "DROPOUT-EXPECTATION", *_KERNEL_KINDS), *kernels)
    failed = [r for r in run.rows if r["status"] == "failed"]
    expected = {("CAUSAL-ZERO-ABOVE", "raises_on_causal"), ("MASK-BOOL", "drops_last_query"),
                ("ATTN-ROWSUM", "not_normalised"), ("DROPOUT-EXPECTATION", "dropout_not_rescaled"),
                ("ATTN-SHIFT-INVARIANT", "not_normalised"), ("ATTN-GRAD-GQA", "gqa_kv_gradient_not_summed"),
                ("DROPOUT-INDEPENDENT", "dropout_mask_shared_across_heads"),
                ("ATTN-OUTPUT-FRESH", "output_memoized_by_address")}
    assert {(r["clause"], r["nodeid"].split(":")[-1].split("-")[0]) for r in failed} >= expected, failed
    # The kernel that memoizes outputs by address is also caught, by chance, wherever the allocator hands a call the
    # addresses of an earlier one: such a failure depends on the process's memory, and a script (a new process)
    # cannot meet it again; it says so instead (never silently missing).
    by_chance = [r for r in failed
                 if "output_memoized_by_address" in r["nodeid"] and r["clause"] != "ATTN-OUTPUT-FRESH"]
    assert all(r["repro"] or r["repro_missing"] for r in by_chance), by_chance
    failed = [r for r in failed if r not in by_chance]
    assert all(r["repro"] for r in failed), [(r["nodeid"], r["repro_missing"]) for r in failed if not r["repro"]]
    for r in failed:
        _script(out, r["repro"].rsplit("/", 1)[1].rsplit("-", 1)[0])
    for clause, line in _KERNEL_KINDS.items():   # the new kinds' own scripts, not a fallback's
        assert any(line in (out / p).read_text() for p in os.listdir(out) if p.startswith(f"{clause}-") and
                   p.endswith(".py")), (clause, sorted(os.listdir(out)))
    # The catalog's bugs live in `properties`: their scripts run on them last, after the suite is importable again.
    failed.sort(key=lambda r: "properties.catalog" in r["nodeid"])
    on_file = sum("properties.catalog" not in r["nodeid"] for r in failed)
    jobs = [[r["repro"], f"{tmp_path}/bugs.py:correct"] for r in failed] + [[r["repro"]] for r in failed]
    assert _exit_codes(tmp_path, jobs, blocked=len(failed) + on_file) == [0] * len(failed) + [1] * len(failed)


_ZOO_TINY = "model=decoder_only d_model=32 heads=2 layers=2 d_ff=64 vocab_size=64 max_len=16"


def test_zoo_decoding_and_gradient_reproducers(tmp_path):
    """--zoo with a broken attention part (the catalog's NoCausalMask, named by _target_): both halves of MODEL-CAUSAL
    (two forward passes; the exact gradient zero through a probe on the embedding) and MODEL-KV-CACHE (cached decoding
    against the full pass) leave scripts that rebuild the zoo model from the config the run composed (seeded as the
    run built it) and exit 1, and 0 on the overrides without the broken part; so does the module clause
    MHA-SINGLE-HEAD (its pinned causal example), whose script rebuilds the attention part from the node the run
    composed and compares with the float64 oracle's values saved in the run. The part lives in properties.catalog:
    here `properties` is the subject's module, importable."""
    run, out = _run(tmp_path, "--zoo", f"{_ZOO_TINY} attention._target_=properties.catalog.models.NoCausalMask",
                    ("MODEL-CAUSAL", "MODEL-KV-CACHE", "MHA-SINGLE-HEAD"))
    failed = [r for r in run.rows if r["status"] == "failed"]
    scripts = sorted({r["repro"] for r in failed if r["repro"]})
    assert {r["clause"] for r in failed} == {"MODEL-CAUSAL", "MODEL-KV-CACHE", "MHA-SINGLE-HEAD"} and len(failed) >= 5, failed
    assert len(scripts) == len(failed), [(r["nodeid"], r["repro_missing"]) for r in failed if not r["repro"]]
    for path in scripts:
        _script(out, path.rsplit("/", 1)[1].rsplit("-", 1)[0])
    jobs = [[p] for p in scripts] + [[p, _ZOO_TINY] for p in scripts]
    assert _exit_codes(tmp_path, jobs, block_suite=False) == [1] * len(scripts) + [0] * len(scripts)


def test_module_reproducers_hold_the_suites_own_functions(tmp_path):
    """FFN-FORMULA, NORM-STANDARDIZE and POS-SINUSOID-FORMULA on broken zoo parts: each script redraws the part's
    parameters with the suite's own ``reinitialize`` and computes with its own sinusoid table and Higham's gamma (their
    source, not copies), exits 1, and 0 on the overrides that compose the correct part (alone, without the suite)."""
    import inspect
    import textwrap

    from properties.core.tolerance import gamma
    from properties.module.oracle import sinusoid_table
    from properties.module.parts import reinitialize
    parts = "properties.catalog.modules"
    run, out = _run(tmp_path, "--zoo", f"{_ZOO_TINY} norm._target_={parts}.LayerNormOverPositions "
                    f"ffn._target_={parts}.FeedForwardWithoutActivation pos._target_={parts}.SinCosSwapped",
                    ("FFN-FORMULA", "NORM-STANDARDIZE", "POS-SINUSOID-FORMULA"))
    fixes = {"FFN-FORMULA": f"{_ZOO_TINY} ffn=relu", "NORM-STANDARDIZE": f"{_ZOO_TINY} norm=layernorm",
             "POS-SINUSOID-FORMULA": f"{_ZOO_TINY} pos=sinusoidal"}
    scripts = {clause: str(_script(out, clause)) for clause in fixes}
    for function in (reinitialize, sinusoid_table, gamma):
        source = textwrap.dedent(inspect.getsource(function))
        assert all(source in (out / path).read_text() for path in scripts.values()), function.__name__
    jobs = [[scripts[c], fix] for c, fix in fixes.items()] + [[path] for path in scripts.values()]
    assert _exit_codes(tmp_path, jobs, blocked=len(fixes)) == [0] * len(fixes) + [1] * len(fixes)


def _run_scripts(cwd, jobs, block_suite: bool = True, blocked: int | None = None) -> list[tuple[int, str, str]]:
    """Each job's script ([path, optional subject]) run as `python path subject` would, all in one fresh isolated
    interpreter (one torch import; -I: no PYTHONPATH, no script directory, no user site) started in ``cwd``, where
    `import properties` fails for the first ``blocked`` jobs (all, or none where ``block_suite`` is False: a subject
    that lives in the suite's catalog): each job's (exit status, stdout, stderr)."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp")}
    blocked = (len(jobs) if block_suite else 0) if blocked is None else blocked
    ran = subprocess.run([sys.executable, "-I", "-c", _DRIVER, json.dumps([[str(w) for w in job] for job in jobs]),
                          str(blocked)], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    return [tuple(result) for result in json.loads(ran.stdout.strip().splitlines()[-1])]


def _exit_codes(cwd, jobs, block_suite: bool = True, blocked: int | None = None) -> list:
    return [code for code, _, _ in _run_scripts(cwd, jobs, block_suite, blocked)]


def test_a_failure_without_a_script_says_why(tmp_path):
    """A failing test that recorded nothing rebuildable: no file, and the reason for the summary and --report-json."""
    from properties.core import evidence
    from properties.core.spec import load_clauses
    from properties.repro.write import write
    evidence.activate(str(tmp_path / "repro"))
    try:
        path, why = write(load_clauses()["ATTN-ROWSUM"], "test_x", "")
    finally:
        evidence.activate(None)
    assert path is None and "records no comparison" in why and not (tmp_path / "repro").exists()


_OFF_BY_ONE = "from properties.catalog.kernels import causal_off_by_one as attention\n"


def _suite_run(cwd, *args):
    from properties.catalog.run import SUITE
    from properties.catalog.sessions import run_pytest
    return run_pytest([str(SUITE / "kernel" / "test_causal.py"), "-p", "no:cacheprovider", "--hypothesis-profile",
                       "pinned", "-k", "test_outputs_ignore_later_keys_and_values", *args], cwd=cwd, timeout=600)


def test_a_run_writes_only_into_a_fresh_directory_of_its_own(tmp_path):
    """What DIR already holds (a user's script of the same name, a link named like a script, a directory named like a
    data file) is never written: the run's scripts go to DIR/run-*; and a `--kernel mod:fn` importable only from
    the run's directory is found by the script from anywhere, its exit statuses meaning one thing each."""
    work, repro = tmp_path / "work", tmp_path / "repro"
    work.mkdir()
    repro.mkdir()
    (work / "mykern.py").write_text(_OFF_BY_ONE)
    (repro / "CAUSAL-NO-FUTURE-1.py").write_text("mine\n")
    (tmp_path / "outside.txt").write_text("keep\n")
    (repro / "CAUSAL-NO-FUTURE-2.py").symlink_to(tmp_path / "outside.txt")
    (repro / "CAUSAL-NO-FUTURE-1.pt").mkdir()
    session = _suite_run(work, "--kernel", "mykern:attention", "--repro-dir", str(repro))
    assert session.returncode == 1, session.output[-3000:]
    assert (repro / "CAUSAL-NO-FUTURE-1.py").read_text() == "mine\n"
    assert (tmp_path / "outside.txt").read_text() == "keep\n"
    runs = [p for p in repro.iterdir() if p.name.startswith("run-")]
    assert len(runs) == 1 and f"in {runs[0]}" in session.output, session.output[-3000:]
    script = _script(runs[0], "CAUSAL-NO-FUTURE")
    # from /, where `mykern` (itself an import of the catalog's kernel) is not importable but for SUBJECT_ROOTS
    ran, refused, two = _run_scripts("/", [[script], [script, "nosuch_module:attention"], [script, "a", "b"]],
                                     block_suite=False)
    assert ran[0] == 1, ran
    assert refused[0] == 2 and refused[2].strip().splitlines()[-1].startswith("CANNOT RUN: the subject"), refused
    assert two[0] == 2, two
    script.with_suffix(".pt").rename(tmp_path / "moved.pt")
    moved = _execute(script)   # a new interpreter, as a user runs it
    assert moved.returncode == 2 and "CANNOT RUN: FileNotFoundError" in moved.stderr, moved.stderr[-2000:]


@pytest.mark.parametrize("outputs", [("--report-json", "X", "--junitxml", "X"),
                                     ("--repro-dir", "R", "--report-json", "R/report.json")])
def test_two_outputs_on_one_path_are_refused_before_the_run(tmp_path, outputs):
    args = [str(tmp_path / word) if word in ("X", "R", "R/report.json") else word for word in outputs]
    session = _suite_run(tmp_path, "--kernel", "math", *args)
    assert session.returncode == 4, session.output[-2000:]
    assert "give each its own path" in session.output or "write the report elsewhere" in session.output
    assert not (tmp_path / "X").exists() and not (tmp_path / "R").exists()


_VARLEN_NAN = '''
from zoo.nn.flash_varlen import flash_attn_varlen_loop


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
    """A sequence with no keys comes out NaN (a 0/0 normaliser) instead of zeros."""
    out = flash_attn_varlen_loop(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw)
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(bq, bq[1:]), zip(bk, bk[1:])):
        if k1 == k0:
            out[q0:q1] = float("nan")
    return out
'''


def test_a_failing_explicit_example_keeps_its_script_when_later_examples_pass(tmp_path):
    """Hypothesis runs every explicit example, those after a failing one too: the script is the failing example's
    (here a NaN output for a packed sequence without keys, which the guard's finiteness check catches), not the
    comparison of an example that passed after it."""
    from properties.catalog.run import SUITE
    from properties.catalog.sessions import run_pytest
    (tmp_path / "varnan.py").write_text(_VARLEN_NAN)
    session = run_pytest([str(SUITE / "kernel" / "test_flash_varlen.py"), "-p", "no:cacheprovider",
                          "--hypothesis-profile", "pinned", "-k", "each_packed_sequence", "--kernel-api", "flash-varlen",
                          "--kernel", "varnan.py:attention", "--repro-dir", "repro"], cwd=tmp_path, timeout=600)
    assert session.returncode == 1 and "no reproducer" not in session.output, session.output[-3000:]
    (script,) = (tmp_path / "repro").glob("run-*/VARLEN-EQUALS-PADDED-1.py")
    done = _execute(script)
    assert done.returncode == 1 and "not finite" in done.stdout, done.stdout + done.stderr
