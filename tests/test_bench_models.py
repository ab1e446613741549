"""The end-to-end model benchmark (``python -m fusedops bench-models``): one tiny CPU run of the
three models in every mode through the command's entry point (JSON, CSV, tables, correctness
record), the argument errors, and the timing machinery's logic (interleaving, GPU-time validity,
verdicts, ``--force-patch``). Speed itself is never asserted."""

from __future__ import annotations

import contextlib
import csv
import inspect
import io
import json
import os
import shutil
import types

import pytest
import torch

from fusedops.__main__ import main as fusedops_main
from fusedops.tools import _model_zoo as zoo
from fusedops.tools import bench_models as bm
from fusedops.tools import bench_models_group as group
from fusedops.tools import bench_models_timing as timing
from fusedops.tools import bench_models_variants as variants_mod
from fusedops.tools.bench_models_common import Options
from fusedops.tools.bench_models_report import format_summary
from fusedops.tools.bench_models_variants import Variant
from fusedops.tools.cli import UsageError

pytest.importorskip("transformers")

ROUNDS = 2
TINY_ARGS = ["--preset", "tiny", "--shapes", "1x8", "--gen-shapes", "1x8", "--rounds", str(ROUNDS),
             "--modes", "infer,train,generate", "--new-tokens", "4", "--threads", "1",
             "--device", "cpu", "--quiet"]
# (model, mode) groups of the tiny run: BERT is an encoder, so it has no generate mode.
GROUPS = [("bert", "infer"), ("bert", "train"), ("gpt2", "infer"), ("gpt2", "train"),
          ("gpt2", "generate"), ("llama", "infer"), ("llama", "train"), ("llama", "generate")]


@pytest.fixture
def one_thread():
    # timings of tiny models on a busy CPU: one thread instead of several spinning ones
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _main(argv: list[str]) -> tuple[int, str, str]:
    # through ``python -m fusedops``'s entry point, which turns a UsageError into one line
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = fusedops_main(["bench-models", *argv])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("bench_models")
    threads = torch.get_num_threads()
    rc, stdout, _ = _main([*TINY_ARGS, "--out", str(out_dir)])
    assert torch.get_num_threads() == threads  # --threads is undone after the run
    with open(out_dir / "bench_models.json") as f:
        result = json.load(f)
    return rc, stdout, result, out_dir


def test_run_succeeds_and_records_metadata(tiny_run):
    rc, _, result, _ = tiny_run
    assert rc == 0
    meta = result["meta"]
    assert meta["argv"][:2] == TINY_ARGS[:2]
    assert meta["versions"]["torch"] == torch.__version__
    assert meta["versions"]["transformers"]
    assert meta["device"]["type"] == "cpu" and meta["device"]["name"]
    assert meta["options"]["variants"] == ["eager", "patched"]  # no compile by default on CPU
    assert meta["options"]["dtype"] == "fp32"
    assert set(result["models"]) == {"bert", "gpt2", "llama"}
    assert result["models"]["llama"]["class"] == "LlamaForCausalLM"
    # the tiny preset really is tiny: 2 layers, hidden 64
    assert result["models"]["bert"]["config"]["num_hidden_layers"] == 2
    assert result["models"]["gpt2"]["config"]["n_embd"] == 64


def test_every_variant_and_mode_has_numbers(tiny_run):
    _, _, result, _ = tiny_run
    records = result["records"]
    assert len(records) == len(GROUPS) * 2
    got = {(r["model"], r["mode"], r["variant"]) for r in records}
    assert got == {(m, mode, v) for m, mode in GROUPS for v in ("eager", "patched")}
    for r in records:
        assert r["status"] == "ok", r
        assert len(r["samples_wall_ms"]) == ROUNDS == len(r["samples_host_ms"])
        assert r["wall_ms"]["p20"] <= r["wall_ms"]["median"] <= r["wall_ms"]["p80"]
        assert 0 < r["host_ms"]["median"] <= r["wall_ms"]["median"] * 1.01
        assert r["first_call_s"] > 0
        assert r["gpu_ms"] is None and r.get("peak_mb") is None  # CUDA only
        assert "gpu_busy_ms" not in r  # CUDA only, after the timed rounds
        if r["mode"] == "generate":
            assert r["shape"] == "1x8+4"
            expected = 1 * 4 / (r["wall_ms"]["median"] / 1e3)
            assert r["tokens_per_s"] == pytest.approx(expected)
        else:
            assert r["shape"] == "1x8" and "tokens_per_s" not in r
        if r["mode"] == "train":
            assert r["check_s"] > 0  # the separate forward/backward correctness pass


def test_ratios_are_computed(tiny_run):
    _, _, result, _ = tiny_run
    assert [(s["model"], s["mode"]) for s in result["summary"]] == GROUPS
    for s in result["summary"]:
        walls = s["wall_ms"]
        ratio = s["ratios"]["patched/eager"]
        assert ratio["ratio"] == pytest.approx(walls["patched"] / walls["eager"])
        assert ratio["rounds"] == ROUNDS
        assert ratio["p20"] <= ratio["p80"]
        assert ratio["verdict"] is None  # two rounds are too few for a verdict
        assert "compiled+patched/compiled" not in s["ratios"]


def test_patched_output_matches_eager(tiny_run):
    _, _, result, _ = tiny_run
    for r in result["records"]:
        if r["variant"] == "eager":
            assert "check" not in r  # the reference
            continue
        check = r["check"]
        assert check["vs"] == "eager" and check["ok"] is True
        if r["mode"] == "generate":
            assert check["token_match"] == 1.0
        else:
            assert check["max_rel"] < 1e-4  # float32 on CPU
            assert check["tol"] == pytest.approx(1e-3)
        if r["mode"] == "train":
            assert check["grad_rel"] < 1e-4 and check["loss_rel"] < 1e-4
    for s in result["summary"]:
        assert s["check_ok"] is True
        assert s["weights_identical"] is True  # every group starts from the same weights


def test_patching_is_recorded_and_undone(tiny_run):
    _, _, result, _ = tiny_run
    for name, mode in GROUPS:
        info = result["models"][name]["modes"][mode]
        assert info["unpatched_ok"] == {"patched": True}
        patch = info["patch"]["patched"]
        assert patch["seconds"] >= 0 and patch["forced"] is False
    bert = result["models"]["bert"]["modes"]["infer"]["patch"]["patched"]
    if not result["meta"]["device"]["fused_kernels_available"]:
        # no fused backend here: patch_model leaves the model as it is unless forced
        assert bert["applied"] is False and bert["replaced"] == 0
    else:
        assert bert["replaced"] == 5


def test_patch_counts_are_recorded():
    opts = Options(force_patch=True, patch_accepts_force=True)
    info = variants_mod.apply_patch(zoo.build("bert", "tiny", torch.device("cpu")), opts)
    assert info["forced"] is True and info["applied"] is True
    assert info["replaced"] == 5  # 2 layers x 2 LayerNorms + the embeddings' LayerNorm
    assert info["fused_types"] == {"FusedLayerNorm": 5}
    assert info["fused_patterns"] > 0


def test_tables_are_printed_summary_last(tiny_run):
    _, stdout, _, _ = tiny_run
    lines = [line for line in stdout.splitlines() if line.strip()]
    header = max(i for i, line in enumerate(lines) if "patched/eager" in line)
    # the summary table closes the output: header, rule, one row per group
    assert len(lines) == header + 2 + len(GROUPS)
    rows = lines[header + 2:]
    assert [row.split()[:3] for row in rows] == [
        [m, "1x8+4" if mode == "generate" else "1x8", mode] for m, mode in GROUPS]
    assert all("?" in row for row in rows)  # ratio shown, verdict withheld at two rounds
    assert "variant" in stdout and "host ms" in stdout and "GPU ms" in stdout  # details table


def test_files_written(tiny_run):
    _, _, _, out_dir = tiny_run
    with open(out_dir / "bench_models.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(GROUPS) * 2
    patched = [r for r in rows if r["variant"] == "patched"]
    assert all(float(r["ratio"]) > 0 and r["ratio_vs"] == "patched/eager" for r in patched)
    assert all(float(r["wall_ms"]) > 0 for r in rows)
    text = (out_dir / "bench_models.txt").read_text()
    assert "patched/eager" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out_dir / "bench_models.png").stat().st_size > 0


@pytest.mark.parametrize("argv, name", [
    (["--models", "nope"], "--models"),
    (["--shapes", "3"], "--shapes"),
    (["--shapes", "8x0"], "--shapes"),
    (["--gen-shapes", "1x"], "--gen-shapes"),
    (["--variants", "eager,fast"], "--variants"),
    (["--modes", ""], "--modes"),
    (["--rounds", "0"], "--rounds"),
    (["--shapes", "1x4096"], "--shapes"),  # beyond the tiny models' 1024 positions
    (["--new-tokens", "2000", "--modes", "generate"], "--gen-shapes/--new-tokens"),
])
def test_bad_arguments_exit_with_one_line(argv, name, tmp_path):
    rc, stdout, stderr = _main([*argv, "--preset", "tiny", "--device", "cpu",
                                "--out", str(tmp_path)])
    assert rc == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and name in lines[0], stderr
    assert lines[0].startswith("fusedops bench-models: error: "), stderr
    assert stdout == "" and not any(tmp_path.iterdir())


def test_parse_shapes():
    assert bm.parse_shapes("1x128, 8X512,1x128") == ((1, 128), (8, 512))
    with pytest.raises(UsageError, match="--gen-shapes"):
        bm.parse_shapes("1x2x3", "--gen-shapes")


def test_time_rounds_interleaves_and_drops_failures():
    calls: list[str] = []

    def step(name):
        return lambda: calls.append(name)

    def broken():
        calls.append("c")
        if calls.count("c") > 2:  # warm-up and round 0 pass, round 1 raises
            raise RuntimeError("out of memory\nsecond line")

    steps = {"a": step("a"), "b": step("b"), "c": broken}
    samples, errors, repeats = timing.time_rounds(steps, lambda: None, rounds=3, warmup=1)
    assert repeats == 1
    assert calls[:3] == ["a", "b", "c"]  # warm-up
    # rounds: the starting variant rotates; c fails in round 1 and is dropped
    assert calls[3:] == ["a", "b", "c", "b", "c", "a", "a", "b"]
    assert errors == {"c": "RuntimeError: out of memory"}
    assert [len(samples[n]) for n in "abc"] == [3, 3, 1]
    assert all(wall >= host >= 0 for wall, host in samples["a"])


def test_rounds_repeat_short_steps(monkeypatch):
    """min_round_s: every variant runs as many steps per round as make the fastest one's round
    about that long (capped), and a sample is the time per step."""
    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    calls: list[str] = []

    def step(name, seconds):
        def run():
            calls.append(name)
            clock[0] += seconds
        return run

    steps = {"fast": step("fast", 0.004), "slow": step("slow", 0.010)}
    samples, errors, repeats = timing.time_rounds(steps, lambda: None, rounds=2, warmup=0,
                                                  min_round_s=0.05)
    assert repeats == 13 and errors == {}  # ceil(0.05 / 0.004)
    assert calls[:2] == ["fast", "slow"]  # the one timed step each that sets the count
    assert calls[2:] == ["fast"] * 13 + ["slow"] * 13 + ["slow"] * 13 + ["fast"] * 13
    assert samples["fast"] == [pytest.approx((0.004, 0.004))] * 2
    assert samples["slow"] == [pytest.approx((0.010, 0.010))] * 2
    steps = {"tiny": step("tiny", 1e-9)}
    assert timing.time_rounds(steps, lambda: None, 1, 0, min_round_s=1.0)[2] \
        == timing.MAX_REPEATS


def test_gpu_times_retries_then_gives_up(monkeypatch):
    # (gpu ms or None, host ms issuing, ms slept): "ok" is valid at once, "late" once the sleep
    # is long enough, "sync" never (its host always waits for the sleep)
    sleeps: dict[str, list[float]] = {"ok": [], "late": [], "sync": []}

    def fake_gpu_once(step, sleep_ms):
        name = step()
        sleeps[name].append(sleep_ms)
        if name == "ok" or (name == "late" and sleep_ms >= 70):
            return 1.5, 10.0, sleep_ms
        return None, sleep_ms + 30.0, sleep_ms

    monkeypatch.setattr(timing, "gpu_once", fake_gpu_once)
    steps = {n: (lambda n=n: n) for n in sleeps}
    got = timing.gpu_times(steps, {"ok": 1.0, "late": 20.0, "sync": 1.0}, samples=3)
    assert got["ok"] == {"gpu_ms": 1.5, "gpu_note": None, "gpu_samples": 3}
    assert sleeps["ok"] == [timing.SLEEP_MIN_MS] * 3
    assert got["late"]["gpu_ms"] == 1.5 and got["late"]["gpu_samples"] == 3
    assert sleeps["late"][:2] == [65.0, 260.0]  # 3 x host + 5 ms, then 4x longer
    assert got["sync"]["gpu_ms"] is None and "waits for the GPU" in got["sync"]["gpu_note"]
    assert len(sleeps["sync"]) == 3  # three attempts, then never again


def test_verdict():
    assert group.verdict(1.10, 1.04, 1.2, rounds=5) == "slower"
    assert group.verdict(0.90, 0.85, 0.97, rounds=5) == "faster"
    assert group.verdict(1.10, 0.95, 1.2, rounds=5) == "same"  # rounds disagree
    assert group.verdict(1.01, 1.01, 1.02, rounds=5) == "same"  # within noise
    assert group.verdict(1.50, 1.40, 1.6, rounds=2) is None


def _fake_patch(force_param: bool):
    calls = []

    def patch_model(model, *, ops=None):
        calls.append({})
        return types.SimpleNamespace(applied=False, replaced=[], fused_patterns=[], skipped=[],
                                     pattern_skipped=[])

    def patch_model_force(model, *, ops=None, force=False):
        calls.append({"force": force})
        return types.SimpleNamespace(applied=force, replaced=[], fused_patterns=[], skipped=[],
                                     pattern_skipped=[])

    return (patch_model_force if force_param else patch_model), calls


@pytest.mark.parametrize("force_param", [True, False])
def test_force_patch_only_where_accepted(monkeypatch, force_param):
    fake, calls = _fake_patch(force_param)
    monkeypatch.setattr(variants_mod, "patch_model_fn", lambda: fake)
    args = bm.build_parser().parse_args(["--force-patch", "--device", "cpu"])
    opts = bm.resolve(args)
    assert opts.patch_accepts_force is force_param
    # the signature is read once, by resolve: patching itself never inspects it again
    monkeypatch.setattr(inspect, "signature", None)
    info = variants_mod.apply_patch(torch.nn.Linear(2, 2), opts)
    assert calls == ([{"force": True}] if force_param else [{}])
    assert info["forced"] is force_param and info["applied"] is force_param


def test_force_patch_ignored_is_said(monkeypatch, tmp_path):
    fake, _ = _fake_patch(False)
    monkeypatch.setattr(variants_mod, "patch_model_fn", lambda: fake)
    rc, stdout, _ = _main([*TINY_ARGS, "--models", "llama", "--modes", "infer", "--force-patch",
                           "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    assert "--force-patch ignored" in stdout
    assert "patch_model applied nothing here" in stdout  # the report's applied=False


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FUSEDOPS_SLOW_TESTS") or shutil.which("g++") is None,
                    reason="set FUSEDOPS_SLOW_TESTS=1 (traces each model with dynamo)")
def test_compiled_variants(tmp_path):
    rc, _, _ = _main(["--preset", "tiny", "--models", "gpt2", "--modes", "infer,generate",
                      "--shapes", "1x8", "--gen-shapes", "1x8", "--new-tokens", "4",
                      "--rounds", "2", "--variants", "eager,patched,compiled,compiled+patched",
                      "--compile-backend", "eager", "--device", "cpu", "--quiet",
                      "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    result = json.loads((tmp_path / "bench_models.json").read_text())
    for r in result["records"]:
        assert r["status"] == "ok", r
        if r["variant"].startswith("compiled"):
            assert r["compile"]["graphs"] >= 1
            assert r["check"]["ok"] is True
    for s in result["summary"]:
        assert s["ratios"]["compiled+patched/compiled"]["ratio"] > 0
        assert s["graphs_compiled_while_timing"] == 0


def test_failed_variant_is_recorded_and_the_rest_measured(one_thread):
    model = zoo.build("gpt2", "tiny", torch.device("cpu"))
    variants = [Variant("eager", model), Variant("patched", model, error="Boom: no")]
    opts = Options(rounds=2, warmup=0, variants=("eager", "patched"))
    records, row = group.run_group(variants, group.Group("gpt2", "infer", 1, 8, None), opts,
                                   torch.device("cpu"))
    by = {r["variant"]: r for r in records}
    assert by["patched"]["status"] == "error" and by["patched"]["error"] == "Boom: no"
    assert by["eager"]["status"] == "ok" and len(by["eager"]["samples_wall_ms"]) == 2
    assert row["ratios"] == {} and row["errors"] == {"patched": "Boom: no"}
    assert "error" in format_summary({"meta": {"options": {"variants": ["eager", "patched"]}},
                                      "summary": [row]})


def test_device_extras_on_cuda_wiring(monkeypatch):
    # The CUDA-only part (GPU time, peak memory) with its measurements faked.
    monkeypatch.setattr(timing, "gpu_times", lambda steps, host: {
        n: {"gpu_ms": 2 * host[n], "gpu_note": None, "gpu_samples": 5} for n in steps})
    monkeypatch.setattr(timing, "peak_memory", lambda step, device: (10.0, 100.0))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None, raising=False)
    steps = {"eager": lambda: None, "patched": lambda: None}
    records = {n: {"host_ms": {"median": 1.5}} for n in steps}
    group.device_extras(steps, records, generate=False, device=torch.device("cpu"))
    assert records["eager"]["gpu_ms"] == 3.0 and records["patched"]["peak_mb"] == 10.0
    records = {n: {"host_ms": {"median": 1.5}} for n in steps}
    group.device_extras(steps, records, generate=True, device=torch.device("cpu"))
    assert "gpu_ms" not in records["eager"] and "every token" in records["eager"]["gpu_note"]
    assert records["eager"]["peak_total_mb"] == 100.0


def test_train_groups_start_from_the_same_weights(one_thread):
    cpu = torch.device("cpu")
    proto = zoo.build("gpt2", "tiny", cpu)
    opts = Options(rounds=2, warmup=1, variants=("eager", "patched"))
    variants, _ = variants_mod.make_variants(proto, "train", opts)
    group.run_group(variants, group.Group("gpt2", "train", 2, 16, None), opts, cpu, proto)
    # the SGD steps moved every copy, each differently (GPT-2's dropout draws differ)
    assert not variants_mod.same_weights([proto, variants[0].model])
    assert not variants_mod.same_weights([variants[0].model, variants[1].model])
    records, row = group.run_group(variants, group.Group("gpt2", "train", 1, 8, None), opts,
                                   cpu, proto)
    assert row["weights_identical"] is True
    assert records[1]["check"]["grad_rel"] < 1e-5


def test_busy_time_counts_overlapping_spans_once():
    assert timing.busy_ms([]) == 0.0
    # µs spans: two overlapping kernels (10-30, 20-40), one nested (22-25), one apart (50-60)
    assert timing.busy_ms([(50, 60), (20, 40), (10, 30), (22, 25)]) == pytest.approx(0.040)
    assert timing.busy_ms([(0, 5), (5, 9)]) == pytest.approx(0.009)  # touching spans


def test_kernel_ms_reads_the_profilers_gpu_records(monkeypatch):
    # The profiler faked: each step leaves one GPU kernel of 100 µs; a CPU event must not
    # count, and a profile with no GPU record raises instead of reading 0.
    import torch.profiler

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ran: list[int] = []

    def event(start, end, device_type):
        return types.SimpleNamespace(time_range=types.SimpleNamespace(start=start, end=end),
                                     device_type=device_type)

    class FakeProfile:
        def __init__(self, activities):
            assert activities == [torch.profiler.ProfilerActivity.CUDA]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return [event(0, 1000, cpu)] + [event(100 + 300 * i, 200 + 300 * i, cuda)
                                            for i in range(len(ran))]

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert timing.kernel_ms(lambda: ran.append(1), steps=2) == pytest.approx(0.1)
    assert ran == [1, 1]
    ran.clear()
    with pytest.raises(RuntimeError, match="no GPU activity"):
        timing.kernel_ms(lambda: None, steps=2)


def test_busy_pass_fills_every_record_after_all_timed_rounds(monkeypatch, tiny_run):
    # The CUDA-only pass run on CPU with the profiler's measurement faked: it comes after every
    # model's timed rounds, builds each model again, warms each variant up, profiles 3 steps
    # (generate: 1) and writes the result (or why it failed) into the matching record.
    _, _, timed, _ = tiny_run
    result = {"records": [dict(r) for r in timed["records"]], "summary": []}
    profiled: list[tuple[str, int]] = []

    def fake_kernel_ms(step, steps):
        out = step()
        profiled.append((type(out).__name__, steps))
        return 1.25

    monkeypatch.setattr(timing, "kernel_ms", fake_kernel_ms)
    opts = bm.resolve(bm.build_parser().parse_args(TINY_ARGS), TINY_ARGS)
    checkpoints: list[int] = []
    for name in opts.models:
        bm._busy_model(name, opts, torch.device("cpu"), result,
                       lambda r: checkpoints.append(len(r["records"])))
    assert len(checkpoints) == len(GROUPS)  # one checkpoint per group
    assert all(r["gpu_busy_ms"] == 1.25 and r["gpu_busy_note"] is None
               for r in result["records"])
    steps = [n for _, n in profiled]
    assert steps.count(1) == 4 and steps.count(timing.KERNEL_STEPS) == len(profiled) - 4

    def broken(step, steps):
        raise RuntimeError("the profiler recorded no GPU activity")

    monkeypatch.setattr(timing, "kernel_ms", broken)
    bm._busy_model("gpt2", opts, torch.device("cpu"), result, None)
    gpt2 = [r for r in result["records"] if r["model"] == "gpt2"]
    assert all(r["gpu_busy_ms"] is None and "no GPU activity" in r["gpu_busy_note"]
               for r in gpt2)


def test_run_measures_busy_times_last_and_only_on_cuda(monkeypatch):
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(bm, "metadata", lambda opts, device: {})
    monkeypatch.setattr(bm, "_run_model", lambda name, *a: calls.append(("timed", name)))
    monkeypatch.setattr(bm, "_busy_model", lambda name, *a: calls.append(("busy", name)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    bm.run(Options(models=("bert", "gpt2"), device="cuda"))
    assert calls == [("timed", "bert"), ("timed", "gpt2"), ("busy", "bert"), ("busy", "gpt2")]
    calls.clear()

    def broken(name, *a):
        calls.append(("busy", name))
        raise RuntimeError("out of memory")

    monkeypatch.setattr(bm, "_busy_model", broken)
    got = bm.run(Options(models=("bert", "gpt2"), device="cuda"))
    assert calls[-2:] == [("busy", "bert"), ("busy", "gpt2")]  # one model's failure, not all
    assert got["meta"]["busy_errors"] == {"bert": "RuntimeError: out of memory",
                                          "gpt2": "RuntimeError: out of memory"}
    calls.clear()
    bm.run(Options(models=("bert",), device="cuda", busy=False))
    bm.run(Options(models=("bert",), device="cpu"))
    assert calls == [("timed", "bert"), ("timed", "bert")]
    assert bm.resolve(bm.build_parser().parse_args([*TINY_ARGS, "--no-busy"])).busy is False


def test_busy_errors_are_reported(tiny_run):
    from fusedops.tools.bench_models_report import format_notes

    _, _, result, _ = tiny_run
    meta = {**result["meta"], "busy_errors": {"llama": "RuntimeError: out of memory"}}
    notes = format_notes({**result, "meta": meta})
    assert "llama: GPU busy time not measured (RuntimeError: out of memory)" in notes


def test_busy_column_in_the_details_table():
    from fusedops.tools.bench_models_report import format_details

    rec = {"model": "gpt2", "shape": "1x8", "mode": "infer", "variant": "eager", "status": "ok",
           "wall_ms": {"median": 2.0, "p20": 1.9, "p80": 2.1}, "host_ms": {"median": 1.5},
           "gpu_ms": None, "gpu_busy_ms": 0.625, "peak_mb": 3.0}
    lines = format_details({"records": [rec]}).splitlines()
    assert "busy ms" in lines[0] and lines[0].index("busy ms") > lines[0].index("GPU ms")
    assert "0.625" in lines[-1]
