"""Our bf16 GEMM for a few rows (``minillm/layers/cpu_bf16_rows.py``): the packed layout, the
kernel against an fp32 product rounded once, its operator's checks, when a traced graph uses
it, and a compiled engine whose free-row graph multiplies through it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from minillm import LLM, SamplingParams, native_build
from minillm.layers import cpu_bf16_rows
from minillm.runtime import compiled_decode

needs_kernel = pytest.mark.skipif(
    cpu_bf16_rows.unavailable_reason() is not None, reason=f"{cpu_bf16_rows.unavailable_reason()}"
)


def test_the_packed_layout_puts_each_column_blocks_input_pairs_side_by_side():
    """``packed[j, p, c, t]`` is ``W[16 j + c, 2 p + t]``: one 64-byte load per block of 16
    columns and pair of inputs, what VDPBF16PS multiplies."""
    n, k = 48, 6
    w = torch.arange(n * k, dtype=torch.float32).view(n, k).to(torch.bfloat16)
    packed = cpu_bf16_rows.pack(w)
    assert packed.shape == (3, 3, 16, 2) and packed.is_contiguous()
    for j, p, c, t in [(0, 0, 0, 0), (0, 0, 0, 1), (1, 2, 5, 1), (2, 1, 15, 0)]:
        assert packed[j, p, c, t] == w[16 * j + c, 2 * p + t]
    assert cpu_bf16_rows.packs(w)
    assert not cpu_bf16_rows.packs(w[:40])  # 40 columns: not whole blocks of 16
    assert not cpu_bf16_rows.packs(w[:, :5])  # an odd number of inputs
    assert not cpu_bf16_rows.packs(w.float())


@needs_kernel
@pytest.mark.parametrize("rows", [*range(1, 14), 25, 40])
@pytest.mark.parametrize("n, k", [(16, 2), (48, 6), (112, 34), (960, 576), (576, 1536)])
def test_the_kernel_is_an_fp32_product_rounded_once(rows, n, k):
    """Every tile the kernel picks by row count (4 column blocks a task up to 6 rows, 3 up to 8,
    2 beyond, in passes of 12 rows), whole tasks and the blocks left over (112 = 7 blocks: 4 + 3,
    6 + 1, 3 × 2 + 1), against the product in fp32: each
    output within bf16's rounding of the exact sum, plus fp32 summation-order slack."""
    torch.manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k).to(torch.bfloat16)
    w = torch.randn(n, k).to(torch.bfloat16)
    exact = x.float() @ w.float().T
    got = torch.ops.minillm.linear_bf16_rows(x, cpu_bf16_rows.pack(w))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n) and got.is_contiguous()
    slack = 2**-8 * exact.abs() + 1e-5 * (x.float().abs() @ w.float().abs().T)
    assert ((got.float() - exact).abs() <= slack).all(), float(((got.float() - exact).abs() - slack).max())


@needs_kernel
def test_no_rows_give_no_rows_and_a_view_is_read_as_its_values():
    w = torch.randn(32, 8).to(torch.bfloat16)
    packed = cpu_bf16_rows.pack(w)
    assert torch.ops.minillm.linear_bf16_rows(torch.empty(0, 8, dtype=torch.bfloat16), packed).shape == (0, 32)
    wide = torch.randn(3, 16).to(torch.bfloat16)
    x = wide[:, ::2]  # not contiguous
    expected = torch.ops.minillm.linear_bf16_rows(x.contiguous(), packed)
    assert torch.equal(torch.ops.minillm.linear_bf16_rows(x, packed), expected)


@needs_kernel
def test_the_operator_passes_pytorchs_operator_checks():
    """What a compiled graph calls: its fake (what the tracer sees) agrees with the kernel on
    shape, dtype and strides, and it traces (``torch.library.opcheck``)."""
    x = torch.randn(5, 64).to(torch.bfloat16)
    packed = cpu_bf16_rows.pack(torch.randn(96, 64).to(torch.bfloat16))
    torch.library.opcheck(torch.ops.minillm.linear_bf16_rows.default, (x, packed))


def _through_the_operator(*args):
    """As a compiled graph calls it: its C++ kernel, registered first (where it can run)."""
    if native_build.build_operators() is not None or not cpu_bf16_rows.operator_in_cpp():
        pytest.skip(f"its C++ kernel cannot run here: {native_build.operators_failure() or cpu_bf16_rows.unavailable_reason()}")
    return torch.ops.minillm.linear_bf16_rows(*args)


# The operator as a compiled graph calls it, and its Python function (the fallback, and what runs
# before the C++ kernel is registered).
CALLS = {"operator": _through_the_operator, "python": cpu_bf16_rows.linear_bf16_rows}


@pytest.mark.parametrize("call", CALLS)
def test_what_would_make_the_kernel_read_out_of_bounds_is_refused_by_name(call):
    """It reads raw pointers: every argument it could misread is checked first, with a
    ValueError naming the operator — on any CPU, before the kernel is needed; by the C++ kernel
    and by the Python function alike."""
    x = torch.randn(3, 64).to(torch.bfloat16)
    packed = cpu_bf16_rows.pack(torch.randn(32, 64).to(torch.bfloat16))
    bad = {
        "fp32 rows": (x.float(), packed),
        "another input width": (x[:, :62], packed),
        "a 3-D input": (x[None], packed),
        "an unpacked weight": (x, torch.randn(32, 64).to(torch.bfloat16)),
        "a non-contiguous packed weight": (x, packed.transpose(2, 3).contiguous().transpose(2, 3)),
        "blocks of 8 columns": (x, packed.view(4, 32, 8, 2)),
        "fp32 packed weight": (x, packed.float()),
    }
    for case, args in bad.items():
        with pytest.raises(ValueError, match="minillm::linear_bf16_rows"):
            CALLS[call](*args)
            pytest.fail(f"{case}: accepted")


@needs_kernel
def test_the_operator_runs_its_cpp_kernel_and_agrees_with_the_python_function():
    """Once the library is loaded, PyTorch's dispatcher holds a C++ kernel for the CPU (registered
    by the library; the Python function is registered for every device, the fallback) — the call
    a compiled graph makes ~121 times a step no longer goes through Python. Both give the same
    bits, for a view too."""
    assert native_build.build_operators() is None, native_build.operators_failure()
    assert cpu_bf16_rows.operator_in_cpp()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("minillm::linear_bf16_rows", "CPU")
    registered = torch._C._dispatch_dump("minillm::linear_bf16_rows")
    assert "CPU: registered at" in registered and ".cpp" in registered.split("CPU: registered at")[1].splitlines()[0]
    packed = cpu_bf16_rows.pack(torch.randn(96, 64).to(torch.bfloat16))
    for rows in (1, 5, 13):
        x = torch.randn(rows, 128).to(torch.bfloat16)[:, ::2]  # not contiguous
        assert torch.equal(torch.ops.minillm.linear_bf16_rows(x, packed), cpu_bf16_rows.linear_bf16_rows(x, packed))


def _exported_ops(enabled: bool, out_features: int = 32, bias: bool = False) -> set[str]:
    linear = torch.nn.Linear(64, out_features, bias=bias).to(torch.bfloat16)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = linear

        def forward(self, x):
            return cpu_bf16_rows.traced_linear(x, self.linear.weight, self.linear.bias)

    with cpu_bf16_rows.in_traced_graph(enabled):
        program = torch.export.export(Model(), (torch.randn(1, 3, 64).to(torch.bfloat16),), strict=False)
    return {str(node.target) for node in program.graph.nodes if node.op == "call_function"}


def test_only_a_graph_traced_for_it_calls_the_kernel():
    """Inside ``in_traced_graph`` a packable bf16 layer becomes the operator on its weight packed
    in the graph (plain tensor operations, which freezing folds into a constant); outside it, or
    for a weight that does not fit the layout, ``F.linear`` as before. Tracing needs only the
    operator's fake, so this holds on any CPU."""
    assert "minillm.linear_bf16_rows.default" in _exported_ops(True)
    assert "minillm.linear_bf16_rows.default" not in _exported_ops(False)
    assert "minillm.linear_bf16_rows.default" not in _exported_ops(True, out_features=40)
    assert "minillm.linear_bf16_rows.default" not in _exported_ops(True, bias=True)
    x = torch.randn(2, 64).to(torch.bfloat16)
    w, b = torch.randn(40, 64).to(torch.bfloat16), torch.randn(40).to(torch.bfloat16)
    with cpu_bf16_rows.in_traced_graph():
        assert torch.equal(cpu_bf16_rows.traced_linear(x, w, None), F.linear(x, w))  # 40 columns: F.linear
        assert torch.equal(cpu_bf16_rows.traced_linear(x, w[:32], b[:32]), F.linear(x, w[:32], b[:32]))  # a bias


def test_which_cpus_use_it_and_the_switch(monkeypatch):
    """By default a CPU with AVX-512 BF16 and no AMX; ``MINILLM_CPU_BF16_ROWS=1`` any with AVX-512
    BF16, ``0`` none; anything else is refused by name."""
    for caps, auto in (({"avx512_bf16": True, "amx_bf16": False}, True), ({"avx512_bf16": True, "amx_bf16": True}, False),
                       ({"avx512_bf16": False}, False)):  # fmt: skip
        monkeypatch.setattr(cpu_bf16_rows, "_capabilities", lambda caps=caps: caps)
        for choice, expected in (("auto", auto), ("1", caps["avx512_bf16"]), ("0", False)):
            monkeypatch.setenv("MINILLM_CPU_BF16_ROWS", choice)
            assert cpu_bf16_rows.cpu_supports() is expected, (caps, choice)
    monkeypatch.setenv("MINILLM_CPU_BF16_ROWS", "yes")
    with pytest.raises(ValueError, match="MINILLM_CPU_BF16_ROWS='yes'"):
        cpu_bf16_rows.cpu_supports()


@needs_kernel
def test_a_compiled_engine_multiplies_its_free_rows_through_the_kernel(tiny_model, tmp_path, monkeypatch):
    """A bf16 engine whose 1-4-row graph was compiled with the kernel (``MINILLM_CPU_BF16_ROWS=1``,
    so that a CPU with AMX tests it too; the compile worker is handed the engine's decision):
    the graph calls the operator, and its greedy tokens and top log-probabilities agree with
    the eager engine's within bf16's rounding (a token may differ only where the eager engine's
    two best were within it). One compile: the suite's time is the course's too."""
    monkeypatch.setattr(compiled_decode, "packages_dir", lambda: tmp_path)
    prompts = ["To be, or not to be", "Caches keep keys and values", "the slings and arrows"]
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3)
    monkeypatch.setenv("MINILLM_CPU_BF16_ROWS", "1")
    compiled = LLM(tiny_model, dtype="bf16", compile=True, compile_batch_sizes=(4,), enable_prefix_caching=False)
    status = compiled.wait_for_fast_path(timeout=600)
    assert status.state == "ready", status
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with_kernel = compiled.generate(prompts, params)
    compiled.close()
    assert sum(e.count for e in prof.key_averages() if e.key == "minillm::linear_bf16_rows") > 0
    eager = LLM(tiny_model, dtype="bf16", compile=False, enable_prefix_caching=False)
    plain = eager.generate(prompts, params)
    for a, b in zip(with_kernel, plain):
        top_a = [[lp for _, lp in step.top] for step in a.logprobs]
        top_b = [[lp for _, lp in step.top] for step in b.logprobs]
        first_difference = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        for x, y in zip(top_a[:first_difference], top_b[:first_difference]):
            assert max(abs(p - q) for p, q in zip(x, y)) < 0.1
        if first_difference is not None:  # only where the two best tokens were within bf16's rounding
            best, second = top_b[first_difference][:2]
            assert best - second < 0.1, (first_difference, a.token_ids, b.token_ids, top_b[first_difference])


def test_a_graph_named_for_the_kernel_is_neither_compiled_nor_loaded_where_it_cannot_run(tiny_model, tmp_path, monkeypatch):
    """Which graphs use the kernel is decided from the CPU and ``MINILLM_CPU_BF16_ROWS`` (read once,
    when the engine names its packages, so no build waits on the engine's thread); a package so
    named always holds the kernel. Where the kernel cannot be built, compiling or loading such a
    package fails with the reason and the way out (the engine then decodes eagerly: a failed
    compile's path, ``test_compiled_decode``) — it never runs a graph that would call a missing
    kernel, nor names a plain graph as the kernel's."""
    from minillm.config import ModelConfig
    from minillm.kvcache.paged import PagedKVCache
    from minillm.models.loader import load_model

    model, config = load_model(tiny_model, torch.bfloat16), ModelConfig.from_folder(tiny_model)
    cache = PagedKVCache(config, 4, 4, torch.bfloat16, torch.device("cpu"))
    graphs = {}
    for choice in ("1", "0"):
        monkeypatch.setenv("MINILLM_CPU_BF16_ROWS", choice)
        graphs[choice] = compiled_decode.CompiledDecode(model, cache, None, torch.float32, (1, 4))
    monkeypatch.setenv("MINILLM_CPU_BF16_ROWS", "0")  # read at construction: a later change does not rename
    on, off = graphs["1"], graphs["0"]
    kernel_cpu = cpu_bf16_rows._capabilities().get("avx512_bf16", False)
    assert on.rows_kernel_here(4) is kernel_cpu and off.rows_kernel_here(4) is False
    assert on.rows_kernel_here(1) is False  # the 1-row graph attends over a window: the compiler's own GEMV
    weights = compiled_decode.weights_digest(model)
    assert (on.digest(weights, 4) != off.digest(weights, 4)) is kernel_cpu
    assert on.digest(weights, 1) == off.digest(weights, 1)
    monkeypatch.setattr(on, "rows_kernel_cpu", True)  # as on a CPU that has it ...
    monkeypatch.setattr(cpu_bf16_rows, "unavailable_reason", lambda: "no compiler for AVX-512 BF16")  # ... but no build
    for attempt in (lambda: on._compile(4, tmp_path / "decode-b4.pt2", False), lambda: on.load(4, tmp_path / "x.pt2")):
        with pytest.raises(RuntimeError, match="no compiler for AVX-512 BF16.*MINILLM_CPU_BF16_ROWS=0"):
            attempt()
    package = tmp_path / "decode-b4-on-disk.pt2"
    package.write_bytes(b"a package built where the kernel ran")
    with pytest.raises(RuntimeError, match="no compiler for AVX-512 BF16"):
        on.try_load(4, package)
    assert package.exists()  # kept: the package is fine, this process cannot run it
    off._check_rows_kernel(4)  # a plain graph does not need it
    monkeypatch.setattr(cpu_bf16_rows, "required", lambda: True)  # MINILLM_CPU_BF16_ROWS=1: asked for, so an error
    assert on.drop_rows_kernel_if_unbuildable() is False and on.rows_kernel_here(4)
    monkeypatch.setattr(cpu_bf16_rows, "required", lambda: False)  # auto: compiled without it, under other names
    before = on.digest(weights, 4)
    assert on.drop_rows_kernel_if_unbuildable() is True and not on.rows_kernel_here(4)
    assert on.digest(weights, 4) != before and on.digest(weights, 4) == off.digest(weights, 4)


def test_the_operator_refuses_to_run_where_the_kernel_cannot(monkeypatch):
    """A CPU without AVX-512 BF16 would die on the first instruction: the operator's Python
    function raises instead, naming itself and the reason (on any CPU: the check comes before the
    kernel is touched). Its C++ kernel asks the CPU itself (``__builtin_cpu_supports``, not
    testable on a CPU that has them), and is registered only where ``unavailable_reason`` found
    the instructions and a build."""
    monkeypatch.setattr(cpu_bf16_rows, "unavailable_reason", lambda: "this CPU has no AVX-512 BF16")
    x = torch.randn(2, 64).to(torch.bfloat16)
    packed = cpu_bf16_rows.pack(torch.randn(32, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="minillm::linear_bf16_rows cannot run here: this CPU has no AVX-512 BF16"):
        cpu_bf16_rows.linear_bf16_rows(x, packed)
    assert not cpu_bf16_rows.operator_in_cpp()


def _tiny_bf16_compiled(tiny_model, batch_sizes):
    from minillm.config import ModelConfig
    from minillm.kvcache.paged import PagedKVCache
    from minillm.models.loader import load_model

    model, config = load_model(tiny_model, torch.bfloat16), ModelConfig.from_folder(tiny_model)
    cache = PagedKVCache(config, 4, 4, torch.bfloat16, torch.device("cpu"))
    return compiled_decode.CompiledDecode(model, cache, None, torch.float32, batch_sizes)


def test_a_compiled_step_registers_the_operators_cpp_kernels_before_its_graphs_load(tiny_model, monkeypatch):
    """``prepare_operators`` (run by the background build before it loads a graph, by ``prepare``,
    and before packages on disk are loaded) builds the operators' library and registers the C++
    kernels of the operators its free-row graph calls — the attention operator always, the bf16
    one where its graphs multiply through it — without a word; a set of graphs that calls neither
    (the 1-row graph alone) builds and registers nothing."""
    from minillm.attention import cpu_paged

    if cpu_paged.kernel_unavailable_reason() is not None:
        pytest.skip(f"the attention kernel did not build here: {cpu_paged.kernel_unavailable_reason()}")
    monkeypatch.setenv("MINILLM_CPU_BF16_ROWS", "1" if cpu_bf16_rows.unavailable_reason() is None else "0")
    only_one_row = _tiny_bf16_compiled(tiny_model, (1,))
    built = []
    with monkeypatch.context() as m:
        m.setattr(native_build, "build_operators", lambda: built.append(1))
        only_one_row.prepare_operators()
    assert built == [] and not only_one_row._operators_registered
    compiled = _tiny_bf16_compiled(tiny_model, (1, 4))
    monkeypatch.setattr(cpu_bf16_rows, "_ANSWERED", [])  # as under =1, where no build step asked ready()'s question first
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled.prepare_operators()
    assert compiled._operators_registered and native_build.operators_failure() is None
    names = ["paged_decode"] + (["linear_bf16_rows"] if compiled.rows_kernel_here(4) else [])
    for name in names:
        cpu = torch._C._dispatch_dump(f"minillm::{name}").split("CPU: registered at")[1].splitlines()[0]
        assert "/operators/" in cpu and ".cpp" in cpu, (name, cpu)  # built from native_operators.cpp


def test_without_the_operators_library_the_python_functions_serve_and_the_engine_says_so_once(tiny_model, monkeypatch):
    """A build of ``native_operators.cpp`` that failed (an old compiler, say) leaves both operators
    on their Python functions: registering says why, and a compiled step warns once."""
    from minillm.attention import cpu_paged

    monkeypatch.setattr(native_build, "_operators", (None, "RuntimeError: no headers here"))
    monkeypatch.setattr(native_build, "build_operators", lambda: "RuntimeError: no headers here")
    assert native_build.register_operator("linear_bf16_rows", []) == "RuntimeError: no headers here"
    assert not cpu_paged.operator_in_cpp() and not cpu_bf16_rows.operator_in_cpp()
    compiled = _tiny_bf16_compiled(tiny_model, (1, 4))
    with pytest.warns(UserWarning, match="operators' C\\+\\+ kernels are not in use .*no headers here"):
        compiled.prepare_operators()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled.prepare_operators()  # said once
