"""The native CPU kernel: bitwise equal to eager for every family, build, cache and fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mixprec.formats import moment_format, resolve_master
from mixprec.optim import MASTER_KINDS, MOMENT_KINDS, AdamW, kernels, native, step_batch
from mixprec.optim.kernels import StepFamily, resolve_mode
from mixprec.optim.rules import RULES
from mixprec.optim.step_batch import StepKernel

from .checkpoint import reload

try:
    native.library()
    HAVE_NATIVE, WHY = True, ""
except native.NativeUnavailableError as exc:  # pragma: no cover - machines without a compiler
    HAVE_NATIVE, WHY = False, str(exc)

needs_native = pytest.mark.skipif(not HAVE_NATIVE, reason=f"native kernel unavailable: {WHY}")

# Tails of every length class, int8 blocks (8192 and 32x256 elements), tiny tensors.
SHAPES = [(4096 + 13,), (7, 11), (3,), (300, 17), (8192,), (32, 256)]


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * 3).to(dtype).requires_grad_() for s in SHAPES]


def _steps(opt: AdamW, params: list[torch.Tensor], steps: range, grad_dtype: torch.dtype) -> None:
    for step in steps:
        for group in opt.param_groups:
            group["lr"] = 1e-2 / (1 + step)
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            # gradient scales from 1e-6 to 1e2: underflowing squares, large moments
            scale = 10.0 ** (step % 9 - 6)
            p.grad_dtype = None  # allow fp32 gradients on bf16 params
            p.grad = (torch.randn(p.shape, generator=gen) * scale).to(grad_dtype)
        opt.step()


def _assert_same(
    a_opt: AdamW, a_params: list[torch.Tensor], b_opt: AdamW, b_params: list[torch.Tensor]
) -> None:
    for a, b in zip(a_params, b_params, strict=True):
        assert torch.equal(a.detach().view(torch.uint8), b.detach().view(torch.uint8))
        for key, value in a_opt.state[a].items():
            other = b_opt.state[b][key]
            assert value.dtype == other.dtype, key
            flat, other_flat = value.reshape(-1), other.reshape(-1)
            assert torch.equal(flat.view(torch.uint8), other_flat.view(torch.uint8)), key


CASES = [
    (master, moments, torch.bfloat16, grad_dtype, maximize)
    for master in MASTER_KINDS
    for moments in MOMENT_KINDS
    for grad_dtype, maximize in ((torch.bfloat16, False), (torch.float32, True))
] + [
    ("none", moments, torch.float32, torch.float32, maximize)
    for moments in MOMENT_KINDS
    for maximize in (False, True)
]


@needs_native
@pytest.mark.parametrize(("master", "moments", "dtype", "grad_dtype", "maximize"), CASES)
def test_native_step_is_bitwise_the_eager_step(
    master: str, moments: str, dtype: torch.dtype, grad_dtype: torch.dtype, maximize: bool
) -> None:
    kw: dict[str, object] = {
        "master": master,
        "moments": moments,
        "maximize": maximize,
        "seed": 3,
        "weight_decay": 0.1,
    }
    ref_p, nat_p = _params(dtype), _params(dtype)
    ref = AdamW(ref_p, fused=False, **kw)  # type: ignore[arg-type]
    nat = AdamW(nat_p, fused=True, **kw)  # type: ignore[arg-type]
    _steps(ref, ref_p, range(6), grad_dtype)
    _steps(nat, nat_p, range(3), grad_dtype)
    nat, nat_p = reload(nat, nat_p, fused=True, **kw)
    _steps(nat, nat_p, range(3, 6), grad_dtype)
    assert set(nat.kernel_backends().values()) == {"native"}
    _assert_same(ref, ref_p, nat, nat_p)


def _assert_same_but_nan_payloads(
    a_opt: AdamW, a_params: list[torch.Tensor], b_opt: AdamW, b_params: list[torch.Tensor]
) -> None:
    """`_assert_same`, except that NaNs need only be NaN on both sides (eager's payloads vary)."""

    def pairs() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for a, b in zip(a_params, b_params, strict=True):
            yield a.detach(), b.detach()
            for key, value in a_opt.state[a].items():
                yield value, b_opt.state[b][key]

    for x, y in pairs():
        assert x.dtype == y.dtype
        x, y = x.reshape(-1), y.reshape(-1)
        if not x.is_floating_point():
            assert torch.equal(x, y)
            continue
        nan = x.isnan()
        assert torch.equal(nan, y.isnan())
        assert torch.equal(x[~nan].view(torch.uint8), y[~nan].view(torch.uint8))


def _odd_values(n: int, gen: torch.Generator) -> torch.Tensor:
    """Normal values mixed with tiny ones (denormal residuals), denormals, zeros and bf16's max."""
    kinds = torch.randint(0, 5, (n,), generator=gen)
    normal = torch.randn(n, generator=gen)
    tiny = torch.randn(n, generator=gen) * 1e-37
    denormal = torch.randn(n, generator=gen) * 1e-40
    out = torch.where(kinds == 0, normal, torch.where(kinds == 1, tiny, denormal))
    out = torch.where(kinds == 3, torch.zeros(n), out)
    out[::97] = 3.3895e38  # bf16's largest: a large step overflows it to inf
    return out


@needs_native
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("maximize", [False, True])
def test_native_kahan_is_bitwise_eager_on_denormal_and_non_finite_values(
    grad_dtype: torch.dtype, maximize: bool
) -> None:
    """The AVX-512 Kahan loop rounds with vcvtneps2bf16, which flushes denormals and keeps NaN
    payloads; the lanes where that differs from eager's rounding must be redone, bitwise."""
    gen = torch.Generator().manual_seed(7)
    n = 4096 + 45
    start = _odd_values(n, gen).to(torch.bfloat16)
    ref_p = [start.clone().requires_grad_()]
    nat_p = [start.clone().requires_grad_()]
    kw: dict[str, object] = {"master": "kahan", "moments": "fp32", "maximize": maximize}
    ref = AdamW(ref_p, fused=False, **kw)  # type: ignore[arg-type]
    nat = AdamW(nat_p, fused=True, **kw)  # type: ignore[arg-type]
    # lr 1e-38 and 1e-36 keep the tiny values' updates tiny (denormal residuals);
    # 1e38 overflows bf16's max to inf; a NaN and an inf gradient make NaN masters.
    saw_inf = saw_denormal = False
    tiny = torch.finfo(torch.float32).tiny
    for step, lr in enumerate((1e-38, 1e-36, 1e-2, 1e-38, 1e38, 1e-37)):
        grads = _odd_values(n, gen) * 10.0 ** (step % 3 - 1)
        if step == 3:
            grads[5], grads[300] = float("nan"), float("inf")
        for opt, params in ((ref, ref_p), (nat, nat_p)):
            opt.param_groups[0]["lr"] = lr
            params[0].grad_dtype = None
            params[0].grad = grads.to(grad_dtype)
            opt.step()
        _assert_same_but_nan_payloads(ref, ref_p, nat, nat_p)
        saw_inf = saw_inf or bool(ref_p[0].isinf().any())
        comp = ref.state[ref_p[0]]["compensation"].float().abs()
        saw_denormal = saw_denormal or bool(((comp > 0) & (comp < tiny)).any())
    assert set(nat.kernel_backends().values()) == {"native"}
    assert saw_inf and saw_denormal and bool(ref_p[0].isnan().any())


def _near_code_boundaries(rows: int, code_max: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of 256 gradients (one int8 block each) whose first-step moments land within a few
    ulps of the int8 codes' rounding boundaries: element 0 is the block's largest (1.0), the
    others ``((k + 0.5) / code_max)**2`` for random codes k, nudged by -8..8 ulps, signs random."""
    k = torch.randint(0, code_max, (rows, 256), generator=gen).double()
    value = ((k + 0.5) / code_max) ** 2
    ulps = torch.randint(-8, 9, (rows, 256), generator=gen).double()
    grads = (value * (1.0 + ulps * 2.0**-23)).float()
    grads = grads * (torch.randint(0, 2, (rows, 256), generator=gen) * 2 - 1)
    grads[:, 0] = 1.0
    return grads


def assert_native_codes_at_boundaries(
    first: torch.Tensor, moments: str, maximize: bool, gen: torch.Generator
) -> None:
    """Three steps of AdamW (remainder8 master) on one bf16 matrix of ``first``'s shape,
    eager against native, bitwise after each: ``first`` (gradients whose first-step moments
    lie near the codes' rounding boundaries), random ones, then ones whose squares
    underflow (denormal v). The last 8 rows never move (maxima of 0), and at the first step
    the 8 before them are denormal."""
    rows, cols = first.shape
    start = (torch.randn(rows, cols, generator=gen) * 0.02).to(torch.bfloat16)
    ref_p = [start.clone().requires_grad_()]
    nat_p = [start.clone().requires_grad_()]
    kw: dict[str, object] = {"master": "remainder8", "moments": moments, "maximize": maximize}
    ref = AdamW(ref_p, fused=False, **kw)  # type: ignore[arg-type]
    nat = AdamW(nat_p, fused=True, **kw)  # type: ignore[arg-type]
    steps = [
        first,
        torch.randn(rows, cols, generator=gen),
        torch.randn(rows, cols, generator=gen) * 1e-20,
    ]
    for step, grads in enumerate(steps):
        grads = torch.cat([grads[: rows - 8], torch.zeros(8, cols)])
        if step == 0:
            grads[rows - 16 : rows - 8] *= 1e-42
        for opt, params in ((ref, ref_p), (nat, nat_p)):
            params[0].grad_dtype = None
            params[0].grad = grads.clone()
            opt.step()
        _assert_same(ref, ref_p, nat, nat_p)
    assert set(nat.kernel_backends().values()) == {"native"}


@needs_native
@pytest.mark.parametrize("maximize", [False, True])
def test_native_int8_codes_are_bitwise_eager_at_their_rounding_boundaries(maximize: bool) -> None:
    """The AVX-512 int8 loops round the codes' square roots from an estimate (rsqrt14 and a
    Newton step) and take the exact root only within 2**-9 of a half integer: moments a few
    ulps from every code boundary (signed and square), zero blocks (a block maximum of 0) and
    denormal moments must still give eager's codes and parameters, bitwise."""
    gen = torch.Generator().manual_seed(11)
    # m's codes: 127 * sqrt(|m| / max), u's: 255 * sqrt(u / max) with u = |g| sqrt(1 - beta2)
    # at the first step; later steps move the moments off the boundaries (random values).
    first = torch.cat([_near_code_boundaries(20, 127, gen), _near_code_boundaries(20, 255, gen)])
    assert_native_codes_at_boundaries(
        torch.cat([first, torch.zeros(8, 256)]), "int8", maximize, gen
    )


@needs_native
def test_native_results_do_not_depend_on_the_thread_count() -> None:
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            params = _params(torch.bfloat16)
            opt = AdamW(params, master="stochastic", moments="int8", seed=0, fused=True)
            _steps(opt, params, range(3), torch.bfloat16)
            runs.append((opt, params))
    finally:
        torch.set_num_threads(threads)
    _assert_same(*runs[0], *runs[1])


@needs_native
def test_native_step_bumps_the_parameter_version() -> None:
    p = torch.ones(4096, dtype=torch.bfloat16, requires_grad=True)
    p.grad = torch.ones_like(p)
    opt = AdamW([p], fused=True)
    before = p._version
    opt.step()
    assert p._version > before
    assert float(opt.master_weights()[0][0]) < 1.0  # the step ran (exact master)


@needs_native
def test_unsupported_params_take_the_fallback_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = native.library()
    t16 = torch.zeros(8, dtype=torch.float16)
    b16 = torch.zeros(8, dtype=torch.bfloat16)
    fam = step_batch.family_of
    fp32_fp32, exact_fp32 = (
        fam("adamw", "fp32", "fp32", maximize=False, block_size=1),
        fam("adamw", "exact", "fp32", maximize=False, block_size=1),
    )
    none_fp32 = fam("adamw", "none", "fp32", maximize=False, block_size=1)
    assert not lib.supports(fp32_fp32, param=t16, grad=t16, block_size=1)
    assert not lib.supports(exact_fp32, param=b16, grad=t16, block_size=1)
    assert not lib.supports(none_fp32, param=torch.zeros(4, 4)[:, 0], grad=b16, block_size=1)
    big = torch.zeros(8192, dtype=torch.bfloat16)
    exact_int8 = fam("adamw", "exact", "int8", maximize=False, block_size=256)
    assert not lib.supports(exact_int8, param=big, grad=big, block_size=native.MAX_BLOCK * 2)
    assert lib.supports(exact_int8, param=big, grad=big, block_size=256)
    # fp16 params on a native kernel: the step goes to the other kernel (here eager).
    family = StepFamily(
        rule=RULES["adamw"],
        master=resolve_master("fp32", torch.float16),
        moments=moment_format("fp32", block_size=256),
        maximize=False,
    )
    kernel = StepKernel(family, mode="native")
    kernel._compiled = None  # fall back to eager instead of compiling in a unit test
    p, ref = [torch.ones(8, dtype=torch.float16, requires_grad=True) for _ in range(2)]
    opt, ref_opt = AdamW([p], master="fp32", fused=True), AdamW([ref], master="fp32", fused=False)
    # (kernels are process-wide, looked up by formats, maximize, block size and mode)
    monkeypatch.setitem(
        step_batch._KERNELS, ("adamw", "fp32", "fp32", False, 256, "native"), kernel
    )
    for q in (p, ref):
        q.grad = torch.full_like(q, 0.5)
    opt.step()
    ref_opt.step()
    assert torch.equal(p, ref)


def test_resolve_mode_with_and_without_the_native_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_mode(True, device_type="cpu", numel=10) == "native"
    assert resolve_mode(None, device_type="cpu", numel=1 << 20) == "native-auto"
    assert resolve_mode(True, device_type="cuda", numel=10) == "compiled"
    monkeypatch.setenv("MIXPREC_NATIVE", "0")
    assert resolve_mode(True, device_type="cpu", numel=10) == "compiled"
    assert resolve_mode(None, device_type="cpu", numel=1 << 20) == "auto"
    with pytest.raises(native.NativeUnavailableError, match="MIXPREC_NATIVE=0"):
        native.library.__wrapped__()


#: The cache tests build with one unoptimised flag set: what they prove (a build is
#: cached, reused, rebuilt when broken, shared by processes starting together) does not
#: depend on the flags, and -O0 builds in a tenth of the -O3 time (71 s against 8.5 s
#: on a loaded machine; six builds). The kernel the other tests check is the -O3 one.
CHEAP_FLAG_SETS = ((*(f for f in native.build.FLAG_SETS[-1] if f != "-O3"), "-O0"),)
#: `CHEAP_FLAG_SETS` in a new process, before it builds.
_CHEAP = f"from mixprec.optim.native import build; build.FLAG_SETS = {CHEAP_FLAG_SETS!r}; "


@pytest.fixture
def fresh_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native.build, "FLAG_SETS", CHEAP_FLAG_SETS)
    native.library.cache_clear()
    kernels.warn_native_unavailable.cache_clear()
    step_batch.clear_kernels()  # kernels are process-wide and hold the library
    yield tmp_path / "native"
    native.library.cache_clear()
    kernels.warn_native_unavailable.cache_clear()
    step_batch.clear_kernels()


@needs_native
@pytest.mark.slow
def test_build_is_cached_and_a_corrupt_library_is_rebuilt(
    fresh_library: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = native.library()
    assert built.info.build_seconds > 0
    assert built.info.path.parent == fresh_library
    assert built.info.flags == native.build.flag_sets()[0]  # recorded beside the library
    native.library.cache_clear()
    cached = native.library()
    assert cached.info.build_seconds == 0.0
    assert cached.info.path == built.info.path
    assert cached.info.flags == built.info.flags
    # A truncated file in another cache (the loader keeps libraries it has
    # mapped by path, so the same path cannot be reused within one process).
    other = fresh_library.parent / "other"
    (other / "native").mkdir(parents=True)
    (other / "native" / built.info.path.name).write_bytes(b"not a shared library")
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(other))
    native.library.cache_clear()
    rebuilt = native.library()
    assert rebuilt.info.build_seconds > 0
    assert rebuilt.info.path == other / "native" / built.info.path.name


@pytest.mark.usefixtures("fresh_library")
def test_no_compiler_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(native.build.shutil, "which", lambda name: None)
    with pytest.raises(native.NativeUnavailableError, match="no C\\+\\+ compiler"):
        native.library()
    p = torch.ones(64, dtype=torch.bfloat16, requires_grad=True)
    opt = AdamW([p], master="exact", fused=True)
    with pytest.warns(RuntimeWarning, match="native CPU kernel is unavailable"):
        kernel = step_batch.kernel_for(
            "adamw", "exact", "fp32", maximize=False, block_size=256, mode=opt._plans[p].mode
        )
    assert not kernel.is_native
    assert kernel.mode == "compiled"  # fused=True: torch.compile instead
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        other = StepKernel(kernel.family, mode="native-auto")
    assert not record  # said once per process
    assert other.mode == "auto"


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads /proc/cpuinfo")
def test_cache_key_covers_the_cpu_model_and_its_feature_flags() -> None:
    # -march=native code must not be loaded on a CPU (or VM) lacking an instruction.
    signature = native.build._cpu_signature()
    assert any(line.startswith(("flags", "Features")) for line in signature.splitlines())


@needs_native
@pytest.mark.slow
def test_processes_starting_together_build_once(tmp_path: Path) -> None:
    code = _CHEAP + "from mixprec.optim import native; "
    code += "print(native.library().info.build_seconds > 0)"
    env = {**os.environ, "MIXPREC_CACHE_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    built = [proc.communicate(timeout=300)[0].strip() for proc in procs]
    assert sorted(built) == ["False", "False", "True"]  # one built, two waited and loaded it


_LOAD = _CHEAP + (
    "from mixprec.optim import native; lib = native.library(); "
    "print(lib.info.build_seconds > 0, lib.info.path)"
)


@needs_native
@pytest.mark.slow
def test_a_truncated_cached_library_is_rebuilt_not_loaded(tmp_path: Path) -> None:
    """A truncated .so in the cache killed the process with SIGBUS when it was mapped."""
    env = {**os.environ, "MIXPREC_CACHE_DIR": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    built, path = first.stdout.split()
    assert built == "True"
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])  # the manifest still names the full file
    again = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True)
    assert again.returncode == 0, (again.returncode, again.stderr[-500:])
    assert again.stdout.split()[0] == "True"  # rebuilt
    assert Path(path).read_bytes() != data[: len(data) // 2]


@needs_native
@pytest.mark.slow
def test_an_unwritable_cache_falls_back_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache folder that cannot be created (a read-only HOME) raised FileNotFoundError."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(native.build, "FLAG_SETS", CHEAP_FLAG_SETS)
    (tmp_path / "tmp").mkdir()
    native.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="cannot write the native kernel cache"):
            lib = native.library()
        assert lib.info.path.is_relative_to(tmp_path / "tmp")
    finally:
        native.library.cache_clear()


def test_the_default_runs_small_cpu_groups_natively() -> None:
    """A small group used to run eagerly under fused=None (14.7 ms against 6.1 ms native
    for 148 small tensors): the native kernel costs no compile, so it is the default."""
    w = torch.nn.Parameter(torch.randn(64, 64))
    opt = AdamW([w])
    w.grad = torch.ones_like(w)
    opt.step()
    want = "native" if native.enabled() else "eager"
    try:
        native.library()
    except native.NativeUnavailableError:
        want = "eager"
    assert set(opt.kernel_backends().values()) == {want}


@needs_native
def test_kernel_backends_says_what_stepped_each_dtype() -> None:
    """fp16 parameters of a family the native kernel covers run on the portable path:
    the report said "native" for them."""
    half = torch.nn.Parameter(torch.randn(100, dtype=torch.float16))
    bf16 = torch.nn.Parameter(torch.randn(100, dtype=torch.bfloat16))
    opt = AdamW([half, bf16], master="fp32")  # fused=None: small portable groups run eagerly
    half.grad, bf16.grad = torch.ones_like(half), torch.ones_like(bf16)
    opt.step()
    assert opt.kernel_backends() == {"adamw_fp32_fp32": "eager+native"}
