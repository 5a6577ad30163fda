"""Every GPU figure the project waits for, from one lease: one command, one total budget.

A lent GPU comes bare (torch, Triton and transformers, none of our other packages, data or
weights) for 15 minutes of device time, start-up included, at most 10 minutes a command. This
script, started there with `.gpu/` beside it (packed here by `benchmarks/gpu_bundle.sh`), installs
what travels with it (`.gpu/setup.sh`), then runs the list in priority order, each step a child
process (a process group: one that hangs or runs out of memory costs only its own box) with its
own time box out of `--budget-s`, what one leaves unused going to those after it:

    tests   the CUDA tests CI cannot run: kernels, the compiled model, the engine, compile modes
            (-k cuda), and heal's tests on the GPU (bf16 autocast, adapters in fp32)
    mmlu    the 7B-shape MMLU sweep (random weights of Llama-2-7B's shape, bf16, compiled blocks)
            on a fixed, named slice: block passes per second and achieved TFLOP/s; the full
            sweep's time DERIVED from the planner's exact count of its block passes (planned in
            a CPU process while the tests run), beside the floor (its FLOPs at this device's
            measured matmul rate)
    speed   `speed` on the 7B shape, 8 of 32 layers removed: prefill, decoding at batch 1 and 32,
            memory, each ratio with its interval, verdict and shares (layers, arithmetic, bytes)
    train   lns-train's step at 130M, compiled, at its best levers (micro-batch 512): tokens/s, MFU
    heal    every heal method on the 7B shape, a few steps each: seconds per method and phase
            (the merges, laco and swm, among them)
    select  `select`'s scoring on the 7B shape: exact at k = 2 (every removal by the prefix walk)
            and a few evo generations, each beside the estimate `select` prints before it starts

`gpu_pass.json` in `--out` is rewritten after every step (atomically), so a pass cut short keeps
every step it finished; a step stopped at its box records how far it came and its rate, never a
guess. One line is printed per step. `--dry-run` runs the same steps on the CPU with tiny shapes
in about a minute, within a budget of 240 s (a test runs it, beside other tests), and there the mmlu step also runs its target, so that the
derivation is checked against a measured run before a GPU's is trusted.

    # on the GPU machine, from a copy of the checkout with .gpu/ (benchmarks/gpu_bundle.sh, run here):
    python3 benchmarks/gpu_pass.py --out DIR
    .venv/bin/python benchmarks/gpu_pass.py --dry-run --out /tmp/pass      # the CPU rehearsal
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), *(str(ROOT / "benchmarks" / part) for part in ("", "prune", "train"))]  # peak_memory; sweep_shapes; norm_throughput
from depthcurse.io import atomic_write  # noqa: E402 (stdlib only: the parent runs before anything is installed)

RESULT = "gpu_pass.json"
# The order is the priority: what a short lease must bring back first. The share is of the
# budget left when the step starts, against the shares of the steps still to run.
STEPS = {"tests": 0.12, "mmlu": 0.3, "speed": 0.13, "train": 0.18, "heal": 0.2, "norms": 0.07, "select": 0.1}
MIN_BOX_S = {"gpu": 20.0, "dry": 3.0}
KILL_GRACE_S = 5.0  # after SIGINT, before SIGKILL: a step's last progress line gets written


@dataclass(frozen=True)
class Sizes:
    """What the steps run: the GPU's shapes, or the dry run's tiny ones on the CPU."""

    device: str
    dtype: str
    shape: str  # a key of sweep_shapes.SHAPES, or "tiny"
    mmlu_slice: int  # questions per subject in the timed slice
    mmlu_target: int  # questions per subject of the run derived (0: all 14,042)
    max_memory: str  # the sweep's budget, the same for the slice and the plan
    speed_layers: tuple[int, ...]
    speed: dict
    train_args: tuple[str, ...]
    norms: dict  # benchmarks/train/norm_throughput.py's settings: every normalisation's step against Pre-LN's
    heal: dict
    tests: tuple[str, ...]
    select: dict  # the windows `select` scores on, k, and evo's settings (a few generations)


GPU = Sizes(device="cuda", dtype="bf16", shape="llama-2-7b", mmlu_slice=10, mmlu_target=0, max_memory="52GB",
            speed_layers=tuple(range(23, 31)),  # k = 8 of 32: the deepest run before the last layer
            speed=dict(prefill_batch=4, prefill_len=2048, decode_batches=(1, 32), prompt_len=512, new_tokens=64),
            train_args=("--device", "cuda", "--preset", "130m", "--compile", "--micro-batch", "512", "--warmup", "5", "--steps", "10"),
            norms=dict(preset="130m", device="cuda", batch_size=64, seq_len=256, kernels="auto"),  # eager: Triton norms
            heal=dict(layers=(24, 25, 26, 27), steps=5, batch_size=4, seq_len=512, eval_windows=2, calib_tokens=8192),
            # heal's first (bf16 autocast, adapters in fp32; they load their models on the GPU), the compile modes last (autotuning is slow)
            tests=("-k", "cuda or test_a_heal_run_measures_three_models or test_heals_numbers_are_plain or test_a_bf16_model_with_tied",
                   "tests/test_heal.py", "tests/test_kernels.py", "tests/test_model.py", "tests/test_engine.py", "tests/test_train.py"),
            select=dict(windows=8, seq_len=512, batch_size=8, k=2, evo={"generations": 3}))
DRY = Sizes(device="cpu", dtype="fp32", shape="tiny", mmlu_slice=2, mmlu_target=6, max_memory="1GB",
            speed_layers=(2,), speed=dict(prefill_batch=1, prefill_len=64, decode_batches=(1, 4), prompt_len=16, new_tokens=4),
            train_args=("--device", "cpu", "--preset", "tiny", "--warmup", "1", "--steps", "2", "--batch-size", "4", "--micro-batch", "4",
                        "--seq-len", "64"),
            norms=dict(preset="tiny", device="cpu", batch_size=2, seq_len=32, kernels="torch", max_rounds=8, warmup=1, vocab=512,
                       shape=dict(num_layers=2, hidden_size=64, intermediate_size=176)),
            heal=dict(layers=(2,), steps=2, batch_size=2, seq_len=64, eval_windows=2, calib_tokens=256),
            tests=("-k", "cuda", "tests/test_kernels.py", "tests/test_model.py"),
            select=dict(windows=2, seq_len=32, batch_size=2, k=2, evo={"generations": 2, "offspring": 2, "initially_generated": 4}))
TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            rope_theta=10000.0, tie_word_embeddings=False)


# --------------------------------------------------------------------------- the parent
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "runs/gpu_pass"), help="folder for gpu_pass.json and each step's log")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds for the whole pass, setup included (default 480; the dry run's 240)")
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU with tiny shapes")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"which, in this order: {','.join(STEPS)}")
    parser.add_argument("--step", choices=[*STEPS, "plan"], help=argparse.SUPPRESS)  # a child: one step
    parser.add_argument("--box-s", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = DRY if args.dry_run else GPU
    if args.step:
        return run_step(args.step, sizes, args.out, args.box_s)
    unknown = [s for s in args.steps.split(",") if s and s not in STEPS]
    if unknown:
        sys.exit(f"error: unknown step {unknown[0]!r}: choose among {','.join(STEPS)}")
    steps = [s for s in STEPS if s in args.steps.split(",")]
    run_pass(steps, sizes, args.out, args.budget_s or (240.0 if args.dry_run else 480.0), args.dry_run)


def box_for(left: float, to_run: list[str], dry: bool) -> float | None:
    """The time box of `to_run[0]`: its share of what is `left` of the budget against the shares of
    the steps still to run (what an earlier step left unused goes to those after it); None where
    that is too short to run it (the step is skipped, and says why)."""
    box = left * STEPS[to_run[0]] / sum(STEPS[s] for s in to_run)
    return box if box >= MIN_BOX_S["dry" if dry else "gpu"] else None


def run_pass(steps: list[str], sizes: Sizes, out: Path, budget_s: float, dry: bool) -> None:
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps").mkdir(exist_ok=True)
    record = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "budget_s": budget_s, "dry_run": dry, "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "gpu": _gpu_name()},
              "steps": {}}
    save = lambda: atomic_write(out / RESULT, json.dumps(record, indent=2) + "\n")  # noqa: E731
    running: list[subprocess.Popen] = []

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    t0 = time.monotonic()
    # The dry run keeps this machine's environment: the bundle's wheels are for the GPU machine's Python.
    # Its figures mean nothing, so one thread a step: OpenMP's threads spinning on a machine
    # that runs other work (CI's other test worker) made the same steps 10-40 times slower.
    env, setup = install_bundle() if not dry else ({**os.environ, "OMP_NUM_THREADS": "1"}, {"status": "ok", "detail": "a dry run: this machine's environment, one thread"})
    record["setup"] = {**setup, "seconds": round(time.monotonic() - t0, 1)}
    save()
    print(f"[setup] {setup['status']} in {record['setup']['seconds']:.1f} s: {setup['detail']}", flush=True)
    plan = None
    if "mmlu" in steps:  # planned on the CPU while the GPU runs the steps before it
        plan = _start(["plan"], out, env, dry, box_s=budget_s)
        running.append(plan)
    name = None
    try:
        for i, name in enumerate(steps):
            left = budget_s - (time.monotonic() - started)
            box = box_for(left, steps[i:], dry)
            if box is None:
                record["steps"][name] = {"status": "skipped", "seconds": 0.0, "box_s": 0.0, "figures": {},
                                         "why": f"{left:.0f} s of the budget left"}
            else:
                proc = _start([name], out, env, dry, box_s=box)
                running.append(proc)
                record["steps"][name] = finish(proc, name, out, box)
                running.remove(proc)
            save()
            print(step_line(name, record["steps"][name]), flush=True)
    except KeyboardInterrupt:
        for proc in running:
            _kill(proc)
        if name is not None and name not in record["steps"]:  # the step it was in: how far that came
            _, progress = read_events(out, name)
            record["steps"][name] = {"status": "interrupted", "seconds": None, "box_s": None, "figures": progress or {},
                                     "why": "the pass was stopped during this step"}
        record["interrupted"] = True
        save()
        raise SystemExit(130)
    finally:
        if plan is not None:
            _kill(plan)
    record["seconds"] = round(time.monotonic() - started, 1)
    save()
    print(f"[pass] {sum(s['status'] == 'ok' for s in record['steps'].values())} of {len(steps)} steps ok in {record['seconds']:.0f} s "
          f"of {budget_s:.0f}; {out / RESULT}", flush=True)
    if any(s["status"] != "ok" for s in record["steps"].values()):
        raise SystemExit(1)  # a step asked for did not finish: a script (or the device call) must not read this as done


def install_bundle(root: Path = ROOT) -> tuple[dict, dict]:
    """The environment the steps run in: after `.gpu/setup.sh` (the carried wheels installed, the
    data put in a cache outside the tree) where the bundle was carried, else this one."""
    setup = root / ".gpu" / "setup.sh"
    if not setup.is_file():
        return dict(os.environ), {"status": "ok", "detail": "no bundle carried (.gpu/): this machine's environment"}
    probe = f"cd {shlex.quote(str(root))} && source .gpu/setup.sh >&2 && {sys.executable} -c 'import json, os; print(json.dumps(dict(os.environ)))'"
    proc = subprocess.run(["bash", "-c", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return dict(os.environ), {"status": "failed", "detail": (proc.stderr.strip().splitlines() or ["setup.sh failed"])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1]), {"status": "ok", "detail": "the carried bundle installed (.gpu/setup.sh)"}


def _start(step: list[str], out: Path, env: dict, dry: bool, box_s: float) -> subprocess.Popen:
    command = [sys.executable, str(Path(__file__).resolve()), "--step", *step, "--out", str(out), "--box-s", f"{box_s:.1f}",
               *(["--dry-run"] if dry else [])]
    log = open(out / "steps" / f"{step[0]}.log", "w")
    # A process group of its own: the step's children (pytest, a benchmark's workers) go with it.
    return subprocess.Popen(command, cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGINT, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def finish(proc: subprocess.Popen, name: str, out: Path, box: float) -> dict:
    """Wait for a step within its box (stopping it at the box), and what it brought back."""
    t0 = time.monotonic()
    try:
        proc.wait(box)
        timed_out = False
    except subprocess.TimeoutExpired:
        _kill(proc)
        timed_out = True
    seconds = round(time.monotonic() - t0, 1)
    result, progress = read_events(out, name)
    entry = {"seconds": seconds, "box_s": round(box, 1)}
    if timed_out:  # a step that had a result when stopped (pytest's summary of the tests it ran) keeps it
        return {"status": "timeout", **entry, "figures": result or progress or {}, "why": f"stopped at its box of {box:.0f} s; figures: how far it came"}
    if result is not None:
        return {"status": "ok", **entry, "figures": result}
    from peak_memory import error_line

    log = (out / "steps" / f"{name}.log").read_text(errors="replace")
    return {"status": "failed", **entry, "figures": progress or {}, "why": error_line(log, proc.returncode)}


def read_events(out: Path, name: str) -> tuple[dict | None, dict | None]:
    """(the step's result, its last progress), from the lines it wrote."""
    path = out / "steps" / f"{name}.jsonl"
    result = progress = None
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line cut by the kill
            if event.pop("event", None) == "result":
                result = event
            else:
                progress = {**(progress or {}), **event}
    return result, progress


def step_line(name: str, entry: dict) -> str:
    figures, head = entry.get("figures") or {}, f"[{name}] {entry['status']} in {entry['seconds']:.1f} s (box {entry['box_s']:.0f} s)"
    said = figures.get("line") or entry.get("why") or ""
    return f"{head}: {said}" if said else head


def _gpu_name() -> str | None:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else None


# --------------------------------------------------------------------------- the children
class Events:
    """A step's lines: progress as it goes (merged; the last of each figure wins), then its result."""

    def __init__(self, path: Path):
        self.path = path
        self.path.write_text("")

    def progress(self, **figures) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": "progress", **figures}) + "\n")

    def result(self, **figures) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": "result", **figures}) + "\n")


def run_step(name: str, sizes: Sizes, out: Path, box_s: float | None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    events = Events(out / "steps" / f"{name}.jsonl")
    started = time.monotonic()
    deadline = started + (box_s or 1e9)
    {"tests": step_tests, "plan": step_plan, "mmlu": step_mmlu, "speed": step_speed, "train": step_train, "heal": step_heal,
     "norms": step_norms, "select": step_select}[name](
        sizes, out, events, deadline)


def _device_facts(sizes: Sizes) -> dict:
    import torch

    from depthcurse.runtime import peak_tflops

    if sizes.device == "cuda":
        name = torch.cuda.get_device_name()
        return {"device": name, "torch": torch.__version__, "peak_tflops": peak_tflops(name, "bf16")}
    return {"device": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(), "peak_tflops": None}


def _tokenizer():
    """SmolLM2's tokenizer: the bundle's copy on the GPU machine, the offline cache's here."""
    from transformers import AutoTokenizer

    from depthcurse import assets

    carried = assets.cache_dir() / "tok"
    return AutoTokenizer.from_pretrained(carried if (carried / "tokenizer.json").is_file() else assets.resolve_model("smollm2-135m"))


def _random_llama(sizes: Sizes, vocab: int, device: str | None = None):
    """A model of the step's shape with random weights (times depend on shapes, not values), on
    its device or `device` (meta: the planner's, with no weights at all)."""
    import torch
    from sweep_shapes import DTYPES, SHAPES
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {**(TINY if sizes.shape == "tiny" else SHAPES[sizes.shape]), "vocab_size": vocab}
    torch.manual_seed(0)
    with torch.device(device or sizes.device):
        model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa")).to(DTYPES[sizes.dtype]).eval()
    return model, shape


def _sync(sizes: Sizes) -> None:
    if sizes.device == "cuda":
        import torch

        torch.cuda.synchronize()


def step_tests(sizes: Sizes, out: Path, events: Events, deadline: float) -> None:
    """pytest; stopped at the box, it gets the same SIGINT (one process group) and still prints
    the summary of the tests it ran, which is this step's result then."""
    import re

    log = out / "steps" / "tests.pytest.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *sizes.tests], cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, text=True)
        try:
            proc.wait()
        except KeyboardInterrupt:
            proc.wait(KILL_GRACE_S - 1)
    text = log.read_text(errors="replace")
    summary = next((line for line in reversed(text.splitlines()) if re.search(r"\d+ (passed|failed|skipped|deselected|error)", line)), "")
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", summary)}
    failed = [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    events.result(command=f"python -m pytest -q {' '.join(sizes.tests)}", exit_code=proc.returncode, counts=counts, failed=failed,
                  line=summary.strip("= ") or f"pytest exited {proc.returncode}")


def _mmlu_requests(sizes: Sizes, tokenizer, model, limit: int):
    from depthcurse.prune.requests import LmEvalRequests
    from depthcurse.tasks import build_task
    from depthcurse.tasks.harness import quiet_lm_eval

    quiet_lm_eval()
    task = build_task("mmlu", tokenizer, limit=limit or None, num_fewshot=0)
    return LmEvalRequests(task, model).requests


def _slice_name(limit: int) -> str:
    return "all of MMLU's test set (14,042 questions)" if not limit else f"MMLU test, the first {limit} questions of each of its 57 subjects"


def step_plan(sizes: Sizes, out: Path, events: Events, deadline: float) -> None:
    """The planner's exact count of the derived run's block passes (the meta device: no GPU, no weights)."""
    import torch
    from sweep_shapes import multiply_adds_per_token

    from depthcurse.prune.layout import MAX_BATCH_TOKENS, lay_out, parse_memory
    from depthcurse.prune.stepping import Stepper

    t0 = time.monotonic()
    tokenizer = _tokenizer()
    model, shape = _random_llama(sizes, len(tokenizer), device="meta")
    requests = _mmlu_requests(sizes, tokenizer, model, sizes.mmlu_target)
    stepper = Stepper(model)
    stepper.device = torch.device(sizes.device)  # that device's rules (prefix sharing, batch cap); nothing runs
    variants = [()] + [(i,) for i in range(stepper.n_layers)]
    layout = lay_out(stepper, requests, variants, max_memory=parse_memory(sizes.max_memory), pack=True, max_batch_tokens=MAX_BATCH_TOKENS[sizes.device])
    passes = layout.block_passes()
    distinct = {r.inputs for r in requests}
    block, head = multiply_adds_per_token(shape, int(sum(map(len, distinct)) / len(distinct)))
    scored = sum(len(r.targets) for r in requests)
    events.result(slice=_slice_name(sizes.mmlu_target), limit=sizes.mmlu_target, requests=len(requests), variants=len(variants),
                  batches=len(layout.batches), block_passes=passes, flops=2 * (passes * block + len(variants) * scored * head),
                  seconds=round(time.monotonic() - t0, 1))


def _wait_for_plan(out: Path, deadline: float, reserve_s: float) -> dict | None:
    while time.monotonic() < deadline - reserve_s:
        plan, _ = read_events(out, "plan")
        if plan is not None:
            return plan
        time.sleep(1.0)
    return None


def _matmul_tflops(sizes: Sizes, shape: dict) -> float:
    """This device's rate on the blocks' largest product (tokens x hidden by hidden x MLP), in its dtype: the floor's rate."""
    import torch
    from sweep_shapes import DTYPES

    tokens = 8192 if sizes.device == "cuda" else 512
    a = torch.randn(tokens, shape["hidden_size"], device=sizes.device, dtype=DTYPES[sizes.dtype])
    b = torch.randn(shape["hidden_size"], shape["intermediate_size"], device=sizes.device, dtype=DTYPES[sizes.dtype])
    for _ in range(3):
        a @ b
    _sync(sizes)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        a @ b
        n += 1
    _sync(sizes)
    return 2 * tokens * shape["hidden_size"] * shape["intermediate_size"] * n / (time.perf_counter() - t0) / 1e12


def _score(sizes: Sizes, stepper, requests, variants, budget, events: Events | None, what: str):
    """One timed sweep of `requests`: (seconds, stats), progress written batch by batch."""
    from depthcurse.prune.scoring import score_requests

    t0 = time.perf_counter()

    def on_batch(done, total):
        if events is not None:
            events.progress(phase=what, batches_done=done, batches=total, seconds=round(time.perf_counter() - t0, 2))

    _, _, stats = score_requests(stepper, requests, variants, max_memory=budget, on_batch=on_batch)
    _sync(sizes)
    return time.perf_counter() - t0, stats


def step_mmlu(sizes: Sizes, out: Path, events: Events, deadline: float) -> None:
    from sweep_shapes import multiply_adds_per_token

    from depthcurse.prune.layout import parse_memory
    from depthcurse.prune.stepping import Stepper

    facts = _device_facts(sizes)
    tokenizer = _tokenizer()
    model, shape = _random_llama(sizes, len(tokenizer))
    requests = _mmlu_requests(sizes, tokenizer, model, sizes.mmlu_slice)
    variants = [()] + [(i,) for i in range(shape["num_hidden_layers"])]
    stepper = Stepper(model, compile=sizes.device == "cuda")  # as `prune --compile` runs
    budget = parse_memory(sizes.max_memory)
    events.progress(phase="warm-up (compiling)", slice=_slice_name(sizes.mmlu_slice), **facts)
    warm_s, _ = _score(sizes, stepper, requests[:64], variants[:2], budget, None, "warm-up")
    events.progress(warmup_s=round(warm_s, 1))
    seconds, stats = _score(sizes, stepper, requests, variants, budget, events, "the slice")
    rate = stats["block_passes"] / seconds
    distinct = {r.inputs for r in requests}
    block, head = multiply_adds_per_token(shape, int(sum(map(len, distinct)) / len(distinct)))
    scored = sum(len(r.targets) for r in requests)
    tflops = 2 * (stats["block_passes"] * block + len(variants) * scored * head) / seconds / 1e12
    figures = {**facts, "slice": _slice_name(sizes.mmlu_slice), "questions_per_subject": sizes.mmlu_slice, "requests": len(requests),
               "variants": len(variants), "max_memory": sizes.max_memory, "warmup_s": round(warm_s, 1), "slice_s": round(seconds, 2),
               "slice_batches": stats["batches"], "slice_block_passes": stats["block_passes"], "block_passes_per_s": rate,
               "achieved_tflops": tflops, "mfu": tflops / facts["peak_tflops"] if facts["peak_tflops"] else None}
    events.progress(**figures)
    matmul = _matmul_tflops(sizes, shape)
    figures["matmul_tflops"] = matmul
    plan = _wait_for_plan(out, deadline, reserve_s=5.0)
    if plan is None:
        figures["derived"] = None
        figures["line"] = f"{rate / 1e6:.3f} M block passes/s, {tflops:.1f} TFLOP/s on the slice; the planner did not finish: nothing derived"
        return events.result(**figures)
    figures["derived"] = {"what": f"DERIVED, not run: {plan['slice']}, {plan['variants']} variants, at the slice's rate", "target": plan["slice"],
                          "block_passes": plan["block_passes"], "batches": plan["batches"], "seconds": plan["block_passes"] / rate,
                          "floor_s": plan["flops"] / (matmul * 1e12), "floor": f"its FLOPs at this device's measured matmul rate ({matmul:.1f} TFLOP/s)"}
    if sizes.device == "cpu":  # the rehearsal also runs its target: the derivation checked against a measured run
        target = _mmlu_requests(sizes, tokenizer, model, sizes.mmlu_target)
        measured_s, measured = _score(sizes, stepper, target, variants, budget, events, "the target")
        # the slice again after the target, so that the spread spans the time the target ran in
        again_s, again = _score(sizes, stepper, requests, variants, budget, None, "the slice again")
        figures["check"] = {"target_measured_s": measured_s, "target_block_passes": measured["block_passes"],
                            "planned_equals_run": measured["block_passes"] == plan["block_passes"],
                            "derived_over_measured": plan["block_passes"] / rate / measured_s,
                            "slice_again_s": again_s, "slice_spread": abs(again_s - seconds) / min(again_s, seconds)}
    d = figures["derived"]
    figures["line"] = (f"{rate / 1e6:.3f} M block passes/s, {tflops:.2f} TFLOP/s" + (f" ({figures['mfu']:.1%} MFU)" if figures["mfu"] else "")
                       + f" on {sizes.mmlu_slice}/subject; {d['target']}: {_duration(d['seconds'])} DERIVED (floor {_duration(d['floor_s'])})"
                       + (f"; measured {_duration(figures['check']['target_measured_s'])}, derived/measured {figures['check']['derived_over_measured']:.3f}"
                          if "check" in figures else ""))
    events.result(**figures)


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.1f} s"


def step_speed(sizes: Sizes, out: Path, events: Events, deadline: float) -> None:
    import torch

    from depthcurse.loading import LoadedModel
    from depthcurse.speed import SpeedConfig, speed_in_memory

    facts = _device_facts(sizes)
    model, shape = _random_llama(sizes, 32000)
    loaded = LoadedModel(model=model, tokenizer=None, name=f"{sizes.shape} shape, random weights", source="random weights", dtype=model.dtype,
                         device=torch.device(sizes.device))
    left = deadline - time.monotonic()
    cfg = SpeedConfig(**sizes.speed, repeats=6, max_repeats=40, max_seconds=max(0.0, left * 0.6))  # the rest: the warm-up and building
    record = speed_in_memory(loaded, sizes.speed_layers, cfg, on_step=lambda name, done, total: events.progress(turns_done=done))
    checks = record["checks"]
    line = "; ".join(f"{key.replace('_time', '')} {c['median']:.3f}x ({c['status']}"
                     + (f", near the {c['regime']} share" if c["regime"] else "") + ")" for key, c in checks.items())
    events.result(**facts, layers_removed=list(sizes.speed_layers), of=shape["num_hidden_layers"], record=record,
                  line=f"k = {len(sizes.speed_layers)} of {shape['num_hidden_layers']}: {line}; peak memory {record['ratios']['peak_memory_prefill']:.3f}x")


def step_train(sizes: Sizes, out: Path, events: Events, deadline: float) -> None:
    target = out / "steps" / "train.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "train" / "train_throughput.py"), *sizes.train_args, "--variants", "trainer", "--out", str(target)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    (out / "steps" / "train.stdout.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not target.is_file():
        from peak_memory import error_line

        raise SystemExit(error_line(proc.stderr, proc.returncode))
    trainer = json.loads(target.read_text())["results"]["trainer"]
    if "error" in trainer:
        raise SystemExit(trainer["error"])
    mfu = trainer.get("mfu")
    events.result(command=" ".join(["train_throughput.py", *sizes.train_args, "--variants", "trainer"]),
                  **{k: trainer.get(k) for k in ("tokens_per_s", "mfu", "median_seconds", "tokens_per_step", "micro_batch", "params", "compile", "precision",
                                                 "peak_bytes", "first_loss", "last_loss")},
                  line=f"{trainer['tokens_per_s']:,.0f} tokens/s" + (f", {mfu:.1%} MFU" if mfu else "") + f" ({trainer['params'] / 1e6:.0f} M parameters)")


def step_norms(sizes: Sizes, out: Path, events: Events, deadline: float) -> None:
    """Every normalisation's training step against Pre-LN's, in turns in one process, until the
    box's last seconds (benchmarks/train/norm_throughput.py)."""
    from norm_throughput import line, measure

    result = measure(deadline=deadline - 2.0, **sizes.norms)
    events.result(command="norm_throughput.measure(" + ", ".join(f"{k}={v!r}" for k, v in sizes.norms.items()) + ")",
                  **result, line=line(result))


def step_heal(sizes: Sizes, out: Path, events: Events, deadline: float) -> None:
    import shutil

    import torch

    from depthcurse.heal import HealConfig, heal, method_names
    from depthcurse.loading import LoadedModel

    facts = _device_facts(sizes)
    tokenizer = _tokenizer()
    folder = out / "steps" / "heal"
    methods = {}
    for method in method_names():
        t0 = time.monotonic()
        model, shape = _random_llama(sizes, len(tokenizer))
        loaded = LoadedModel(model=model, tokenizer=tokenizer, name=f"{sizes.shape} shape, random weights", source="random weights",
                             dtype=model.dtype, device=torch.device(sizes.device))
        built = time.monotonic() - t0
        common = {k: v for k, v in sizes.heal.items() if k != "calib_tokens"}
        cfg = HealConfig(method=method, method_args={"calib_tokens": sizes.heal["calib_tokens"]}, data="wiki", save_every=10**6, seed=0,
                         **common).for_method(method).resolved()
        phases, last = {}, [time.monotonic(), "starting"]

        def phase(text, last=last, phases=phases):
            now = time.monotonic()
            phases[last[1]] = round(phases.get(last[1], 0.0) + now - last[0], 2)
            last[:] = [now, text]

        record = heal(loaded, cfg, folder / method, on_phase=phase)
        phase("done")
        shutil.rmtree(folder / method / "hf", ignore_errors=True)  # a 7B checkpoint per method would fill the disk
        methods[method] = {"seconds": round(time.monotonic() - t0, 2), "build_model_s": round(built, 2), "phases": phases, "cost": record.get("cost"),
                           "training": record.get("training")}
        events.progress(methods=methods)
        del model, loaded, record
        if sizes.device == "cuda":
            torch.cuda.empty_cache()
    events.result(**facts, layers=list(sizes.heal["layers"]), settings={k: v for k, v in sizes.heal.items() if k != "layers"}, methods=methods,
                  line="; ".join(f"{m} {r['seconds']:.1f} s" for m, r in methods.items()) + " (times only: random weights)")


def step_select(sizes: Sizes, out: Path, events: Events, deadline: float) -> None:
    """exact at k = 2 and a few evo generations on random windows of the step's shape, each timed
    beside what `select` would have said before it started (its estimate from a timed pass)."""
    from dataclasses import asdict

    import torch

    from depthcurse.select.estimate import pass_timing
    from depthcurse.select.scoring import CalibrationScorer
    from depthcurse.select.search import SearchContext, Space, build_searches

    facts = _device_facts(sizes)
    s = sizes.select
    model, shape = _random_llama(sizes, 32000)
    windows = torch.randint(0, 32000, (s["windows"], s["seq_len"]), generator=torch.Generator().manual_seed(0))
    timing = pass_timing(model, windows, s["batch_size"])
    space = Space(shape["num_hidden_layers"], s["k"], timing=timing)
    searches = build_searches(("exact", "evo"), {f"evo.{k}": str(v) for k, v in s["evo"].items()})
    figures = {}
    for name, search in searches.items():
        search.check(space)
        scorer = CalibrationScorer(model, windows, s["batch_size"], {}, lambda: None)
        ctx = SearchContext(space=space, objective="kl", windows=len(windows), window_tokens=windows.shape[1], streams=None, seed=0,
                            score=lambda r, scorer=scorer: scorer(r)["kl"], score_many=lambda rs, scorer=scorer: [d["kl"] for d in scorer.score_many(rs)],
                            score_on=lambda r, w, t, scorer=scorer: scorer.score_on(r, w, t, "kl"),
                            score_on_many=lambda rs, w, t, scorer=scorer: scorer.score_on_many(rs, w, t, "kl"))
        blocks, heads = search.passes(space, windows.numel())
        _sync(sizes)
        t0 = time.monotonic()
        chosen = search.run(ctx)
        _sync(sizes)
        took = time.monotonic() - t0
        cost = scorer.cost.summary(len(windows))
        figures[name] = {"seconds": round(took, 2), "estimate_s": round(timing.seconds(blocks, heads), 2), "chosen": list(chosen),
                         "estimated_passes": [round(blocks, 1), round(heads, 1)], "cost": cost}
        events.progress(searches=figures)
    events.result(**facts, timing=asdict(timing), settings=s, searches=figures,
                  line="; ".join(f"{n} {f['seconds']:.1f} s (estimated {f['estimate_s']:.1f} s)" for n, f in figures.items()) + " (times only: random weights)")


if __name__ == "__main__":
    main()
