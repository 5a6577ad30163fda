"""The few-row kernel (`depthcurse.few_row_linear`, issue 89 item 5): speculate's check of gamma + 1
tokens by a matmul that reads each weight once for all its rows. Against torch's linear at every row
count and shape remainder, the cases it leaves to torch, the layers it takes, the check's logits of
a tiny Llama, and each way it can fail to be built, said in the record's words."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from depthcurse import few_row_linear, kernel_build
from depthcurse.few_row_linear import few_row_kernel
from helpers import fresh_kernel_cache, needs_compiler, tiny_llama

pytestmark = pytest.mark.instruments
BUILT = "depthcurse's few-row kernel at 2-8 rows (each weight read once for all rows), torch's linear otherwise"


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    yield from fresh_kernel_cache(monkeypatch, tmp_path, few_row_linear, "DEPTHCURSE_FEW_ROW_KERNEL")


def layer(width: int, out: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(width, out, bias=bias)


def test_the_kernel_builds_here_and_says_so():
    # wherever a compiler is (CI's machine has one), the kernel builds: one that silently fell back would leave the rest untested
    if kernel_build.compiler() is None:
        pytest.skip("no C++ compiler on this machine: speculate uses torch's linear")
    assert few_row_linear.status() == BUILT


@needs_compiler
@pytest.mark.parametrize("width,out,bias", [(45, 37, False), (576, 40, True), (16, 3, False), (7, 9, True), (576, 1536, True)])
def test_every_row_count_equals_torchs_linear(width, out, bias):
    # widths past a multiple of the 16 lanes, and output counts past a multiple of every block's rows; the
    # last, SmolLM2's MLP, past kernel_build.GRAIN: on torch's threads (the others on the calling one)
    lin = layer(width, out, bias)
    x = torch.randn(12, width, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = [F.linear(x[:rows], lin.weight, lin.bias) for rows in range(1, 13)]
        with few_row_kernel(lin):
            got = [lin(x[:rows]) for rows in range(1, 13)]
    for rows, (g, w) in enumerate(zip(got, want), start=1):
        if rows in few_row_linear.ROWS:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        else:  # 1 and 9-12 rows are torch's own, to the bit
            assert torch.equal(g, w), rows


@needs_compiler
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    # the kernel sums every output in one order whatever the rows; MKL's GEMM does not promise that,
    # so this also shows the kernel, not torch, computed rows 2-8
    lin = layer(96, 50)
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), few_row_kernel(lin):
        first = [lin(x[:rows])[0] for rows in few_row_linear.ROWS]
    assert all(torch.equal(f, first[0]) for f in first)


@needs_compiler
def test_inputs_of_many_dims_and_strides_are_taken_as_their_rows():
    lin = layer(32, 24, bias=True)
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(3))[..., ::2]  # [1, 5, 32], not contiguous
    with torch.no_grad(), few_row_kernel(lin):
        got = lin(x)
    assert got.shape == (1, 5, 24)
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@needs_compiler
def test_what_the_kernel_does_not_compute_is_torchs_to_the_bit():
    lin = layer(32, 24)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    with few_row_kernel(lin):
        with torch.no_grad(), pytest.raises(RuntimeError, match="dtype"):
            lin(x.bfloat16())  # not fp32: torch's linear, which refuses the mixed dtypes
        wants_grad = lin(x)  # a gradient asked for: the kernel has no backward
        wants_grad.sum().backward()
    assert torch.equal(wants_grad, F.linear(x, lin.weight))
    assert lin.weight.grad is not None and torch.equal(lin.weight.grad, torch.ones(24, 5) @ x)


class HookedLinear(nn.Linear):
    pass


@needs_compiler
def test_only_plain_fp32_linears_are_taken_and_every_one_is_given_back():
    model = nn.ModuleDict({"plain": layer(16, 8), "sub": HookedLinear(16, 8), "bf16": layer(16, 8).bfloat16(),
                           "hooked": layer(16, 8), "other": nn.LayerNorm(16), "strided": layer(16, 8)})
    model["hooked"]._hf_hook = object()  # accelerate's offloading moves the weight in its own forward
    model["strided"].weight = nn.Parameter(torch.randn(16, 8).t())  # the kernel reads a weight's rows as they lie
    with few_row_kernel(model) as said:
        assert said == BUILT
        assert [name for name, m in model.items() if "forward" in vars(m)] == ["plain"]
        with few_row_kernel(model):  # an enclosing block's layers are left to it
            assert "forward" in vars(model["plain"])
        assert "forward" in vars(model["plain"])
    assert not any("forward" in vars(m) for m in model.values())


@needs_compiler
def test_given_back_after_an_error_inside():
    lin = layer(16, 8)
    with pytest.raises(ValueError), few_row_kernel(lin):
        raise ValueError
    assert "forward" not in vars(lin)


@needs_compiler
def test_a_tiny_llamas_check_gives_torchs_logits_and_tokens():
    from depthcurse.speculate.draft import CachedModel

    model = tiny_llama(64, layers=3)
    prompt = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(5))
    check = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(6))
    lm = CachedModel(model)
    lm.feed(prompt)
    want = lm.feed(check)
    lm.keep(12)
    with few_row_kernel(model):
        got = lm.feed(check)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_told_not_to_it_is_torchs_linear(fresh_kernel, monkeypatch):
    monkeypatch.setenv("DEPTHCURSE_FEW_ROW_KERNEL", "0")
    lin = layer(16, 8)
    with few_row_kernel(lin) as said:
        assert "forward" not in vars(lin)
    assert said == "torch's linear (its own GEMM at 2-8 rows): DEPTHCURSE_FEW_ROW_KERNEL=0"
    assert not (fresh_kernel / "cache").exists()  # nothing compiled


def test_without_a_compiler_it_is_torchs_linear_and_says_why(fresh_kernel, monkeypatch):
    false = shutil.which("false") or "/bin/false"  # a compiler that fails and says nothing
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(kernel_build.shutil, "which", lambda name: None)
    assert few_row_linear.status() == ("torch's linear (its own GEMM at 2-8 rows): the few-row kernel could not be built or loaded "
                                       "(no C++ compiler (c++, g++ or clang++ on PATH, or CXX))")
    few_row_linear.kernel.cache_clear()
    monkeypatch.setenv("CXX", str(fresh_kernel / "no-such-compiler"))
    assert few_row_linear.status().startswith("torch's linear (its own GEMM at 2-8 rows): the few-row kernel could not be built or loaded "
                                              f"({fresh_kernel / 'no-such-compiler'} cannot be run (No such file or directory))")
    few_row_linear.kernel.cache_clear()
    monkeypatch.setenv("CXX", false)
    assert few_row_linear.status() == "torch's linear (its own GEMM at 2-8 rows): the few-row kernel could not be built or loaded (false failed: exit 1)"


@needs_compiler
def test_a_build_that_computes_otherwise_is_not_used(fresh_kernel, monkeypatch):
    wrong = fresh_kernel / "wrong.cpp"
    wrong.write_text(few_row_linear.SOURCE.read_text().replace("y[r * N + n0 + j] = s;", "y[r * N + n0 + j] = s + (R == 3);"))
    monkeypatch.setattr(few_row_linear, "SOURCE", wrong)
    said = few_row_linear.status()
    assert said.startswith("torch's linear (its own GEMM at 2-8 rows): the few-row kernel was built but it differs from torch's linear at 3 rows (by up to 1")
    lin = layer(16, 8)
    with few_row_kernel(lin):
        assert "forward" not in vars(lin)


@needs_compiler
def test_a_build_is_kept_and_found_again_per_source_command_and_cpu(fresh_kernel, monkeypatch):
    folder = fresh_kernel / "kernels"
    first = kernel_build.build(few_row_linear.SOURCE, folder=folder)
    assert first.parent == folder and first.name.startswith("few_row_linear-") and first.suffix == ".so"

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(kernel_build.subprocess, "run", no_compiling)
    assert kernel_build.build(few_row_linear.SOURCE, folder=folder) == first
    assert sorted(p.name for p in folder.iterdir()) == [first.name]  # no temporary folder left behind
    source = few_row_linear.SOURCE.read_text()
    command = ["c++", *kernel_build.FLAGS]
    names = {kernel_build.build_name(few_row_linear.SOURCE, source, command), kernel_build.build_name(few_row_linear.SOURCE, source + "\n", command),
             kernel_build.build_name(few_row_linear.SOURCE, source, [*command, "-O2"])}
    assert len(names) == 3
    monkeypatch.setattr(kernel_build, "cpu_model", lambda: "another CPU")
    assert kernel_build.build_name(few_row_linear.SOURCE, source, command) not in names


@needs_compiler
def test_a_compile_past_its_time_is_said(fresh_kernel, monkeypatch):
    def slow(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kernel_build.COMPILE_SECONDS)

    monkeypatch.setattr(kernel_build.subprocess, "run", slow)
    said = few_row_linear.status()
    assert said.startswith("torch's linear (its own GEMM at 2-8 rows): the few-row kernel could not be built or loaded (Command '")
    assert said.endswith("timed out after 300 seconds)")


@needs_compiler
def test_a_cached_build_that_will_not_load_is_said(fresh_kernel):
    folder = fresh_kernel / "cache" / "kernels"
    folder.mkdir(parents=True)
    source = few_row_linear.SOURCE.read_text()
    (folder / kernel_build.build_name(few_row_linear.SOURCE, source, [kernel_build.compiler(), *kernel_build.FLAGS])).write_bytes(b"not a library")
    said = few_row_linear.status()
    assert said.startswith("torch's linear (its own GEMM at 2-8 rows): the few-row kernel could not be built or loaded (") and "not a library" not in said


def test_a_model_with_no_layer_to_take_builds_nothing_and_says_so(monkeypatch):
    # a model on a GPU or in bf16: the record says torch's linear, and no compiler is asked
    def no_building():
        raise AssertionError("the kernel was asked for")

    monkeypatch.setattr(few_row_linear, "kernel", no_building)
    model = nn.Sequential(layer(16, 8).bfloat16(), HookedLinear(8, 4))
    with few_row_kernel(model) as said:
        assert not any("forward" in vars(m) for m in model)
    assert said == few_row_linear.NO_LAYER == "torch's linear (no plain fp32 linear layer on the CPU for the few-row kernel)"
