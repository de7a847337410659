"""Chapter 07's whole piece: the learner's int4 linear layer — quantize a weight group-wise, pack
two values per byte, and multiply with the weight dequantized on the fly.

``Int4Linear(weight, group_size, bias=None)`` keeps only the packed bytes, the groups' scales and
minima, and the bias when there is one (``tensors()`` lists what it keeps); ``layer(x)`` returns
``x @ Ŵᵀ + bias``. Two stages:

1. **diagnosis on a hand-made layer** — shapes it must refuse with a ``ValueError`` (inputs that
   are not whole groups, an odd number of inputs that cannot pack in pairs, a group of 0 inputs),
   then a random ``[32, 64]`` weight in groups of 16: the bytes it keeps (half a byte per weight
   plus the groups' two numbers, or a named reason why not), then the weight it effectively multiplies by
   (read back by multiplying the identity) against the reference quantizer's and its classic
   variants (the nibbles swapped, no minimum, one scale per row, truncation instead of rounding,
   16 levels out of range), the output dtype, the same layer with a bias (added once, in the
   activations' dtype, kept and listed), and the edges: refusals whose messages name the numbers
   that clash, a group of 1 input (allowed, and exact), activations of the wrong width;
2. **the plug-in run** — the learner's class as the weight method of every int4 layer of the
   real engine (the tiny model, fp32, ``quantization="int4"``): greedy tokens equal to the
   package's int4 engine.
"""

from __future__ import annotations

import torch

from minillm.course.compare import compare_requests, compare_tensors, name_the_slip
from minillm.course.results import CheckFailed, check, learner_function

OUT, IN, GROUP = 32, 64, 16


def reference_weight(weight: torch.Tensor, group_size: int, mistake: str | None = None) -> torch.Tensor:
    """The weight an int4 layer multiplies by (``q * scale + minimum`` per group), or a slip's."""
    out, cols = weight.shape
    groups = cols if mistake == "per_row" else group_size
    w = weight.float().reshape(out, cols // groups, groups)
    low, high = w.amin(-1), w.amax(-1)
    levels = 16.0 if mistake == "sixteen_levels" else 15.0
    scale = ((high - low) / levels).clamp(min=1e-12)
    ratio = (w - low[..., None]) / scale[..., None]
    q = (ratio.floor() if mistake == "truncated" else torch.round(ratio)).clamp(0, 15)
    if mistake == "swapped_nibbles":
        q = q.reshape(out, -1, 2).flip(-1).reshape(q.shape)
    back = q * scale[..., None] + (0 if mistake == "no_minimum" else low[..., None])
    return back.reshape(out, cols)


MISTAKES = {
    "swapped_nibbles": "the weight comes back with each pair of neighbours swapped: pack and unpack must agree on "
    "the order — the even column in the low nibble (q[:, 0::2] | q[:, 1::2] << 4), and & 0x0F gives it back first",
    "no_minimum": "the dequantized weight is q * scale without the group's minimum: add it back, q * scale + minimum",
    "per_row": "every row has one scale and minimum: int4 needs one per group of group_size inputs (a row's range "
    "is too wide for 16 levels)",
    "truncated": "the levels were truncated (a cast to uint8 floors): round to the nearest level first, "
    "torch.round((w - minimum) / scale)",
    "sixteen_levels": "the scale divides the range by 16: 4 bits give levels 0..15, so the step is (max - min) / 15",
}


def _held_bytes(layer) -> int:
    tensors = learner_function(layer.tensors)()
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise CheckFailed("Int4Linear.tensors() should return a list of the tensors the layer keeps")
    return sum(t.numel() * t.element_size() for t in tensors)


#: (out, in, group_size, why the shape cannot be an int4 layer)
REFUSED = [
    (8, 20, 16, "20 inputs are not whole groups of 16"),
    (8, 15, 5, "15 inputs are whole groups of 5, but an odd count: the last value would have no byte-mate"),
    (8, 64, 0, "a group of 0 inputs holds nothing to scale"),
]


def _check_refusals(Int4Linear) -> list:
    """Each shape of ``REFUSED`` raises ValueError; returns ``(call, error, the two numbers)`` for
    ``_check_edges`` to read the messages once the layer's arithmetic is known right."""
    from minillm.course.results import LearnerRaised

    refused = []
    for out, cols, group, why in REFUSED:
        call = f"Int4Linear(weight[{out}, {cols}], group_size={group})"
        try:
            made = learner_function(Int4Linear)(torch.randn(out, cols), group)
        except LearnerRaised as err:
            if isinstance(err.__cause__, ValueError):
                refused.append((call, err.__cause__, cols, group))
                continue
            if isinstance(err.__cause__, NotImplementedError):  # the skeleton: not attempted yet
                raise
            raise CheckFailed(f"{call} raised {type(err.__cause__).__name__}: {err.__cause__}. {why}: check the "
                              "shape first and raise ValueError, the error a bad argument gets, naming both "
                              "numbers") from None  # fmt: skip
        raise CheckFailed(f"{call} built a layer ({type(made).__name__}) instead of raising ValueError: {why} — "
                          "refuse it before quantizing")  # fmt: skip
    return refused


def _check_edges(Int4Linear, refused: list) -> None:
    """The refusals' messages name the numbers that clash; a group of 1 is allowed; activations of
    the wrong width get a ValueError naming both widths, not the matmul's shapes."""
    from minillm.course.results import LearnerRaised

    for call, err, first, second in refused:
        _names_both(call, err, first, second)
    weight = torch.randn(4, 6)  # the smallest group there is: every weight its own, kept exactly
    try:
        layer = learner_function(Int4Linear)(weight, 1)
    except LearnerRaised as err:
        if isinstance(err.__cause__, NotImplementedError):
            raise
        raise CheckFailed(f"Int4Linear(weight[4, 6], group_size=1) raised {type(err.__cause__).__name__}: "
                          f"{err.__cause__}. A group of 1 input is allowed (each weight its own group, given back "
                          "exactly): refuse only group sizes below 1") from None  # fmt: skip
    x = torch.randn(2, 6)
    compare_tensors(learner_function(layer.__call__)(x), x @ weight.T,
                    "Int4Linear(weight[4, 6], group_size=1) on x[2, 6] (every weight its own group: exact)")  # fmt: skip
    layer = learner_function(Int4Linear)(torch.randn(OUT, IN), GROUP)
    call = f"Int4Linear(weight[{OUT}, {IN}], group_size={GROUP}) on x[3, {IN // 2}]"
    try:
        got = learner_function(layer.__call__)(torch.randn(3, IN // 2))
    except LearnerRaised as err:
        if isinstance(err.__cause__, ValueError):
            _names_both(call, err.__cause__, IN // 2, IN)
            return
        if isinstance(err.__cause__, NotImplementedError):
            raise
        raise CheckFailed(f"{call} raised {type(err.__cause__).__name__}: {err.__cause__}. The activations have "
                          f"{IN // 2} features where the layer takes {IN}: compare x.shape[-1] with the layer's "
                          "input features first and raise ValueError naming both") from None  # fmt: skip
    raise CheckFailed(f"{call} returned {type(got).__name__} instead of raising ValueError: the layer takes {IN} "
                      f"input features, x has {IN // 2}")  # fmt: skip


def _names_both(call: str, err: Exception, first: int, second: int) -> None:
    """A refusal's message must name the numbers that clash, so the caller can see which to change."""
    if str(first) not in str(err) or str(second) not in str(err):
        raise CheckFailed(f"{call} raised ValueError({str(err)!r}): name both numbers, {first} and {second}, in "
                          "the message, so whoever called it sees which one to change")  # fmt: skip


def _check_bias(Int4Linear, weight: torch.Tensor, expected: torch.Tensor, gen: torch.Generator) -> None:
    """The same layer with a bias: added once, in the activations' dtype, kept and listed by tensors()."""
    import inspect

    try:
        inspect.signature(Int4Linear).bind(weight, GROUP, bias=None)
    except TypeError:
        raise CheckFailed("Int4Linear takes a bias too: add the parameter bias=None (a layer without one passes "
                          "None)") from None  # fmt: skip
    except ValueError:  # no signature to read: the call says it
        pass
    bias = torch.randn(OUT, generator=gen) * 0.1
    given = bias.clone()
    layer = learner_function(Int4Linear)(weight.clone(), GROUP, given)
    call = learner_function(layer.__call__)
    x = torch.randn(3, IN, generator=gen)
    got, want = call(x), x @ expected.T + bias
    if not torch.equal(given, bias):
        raise CheckFailed("Int4Linear changed the bias it was given in place: keep a copy")
    if isinstance(got, torch.Tensor) and got.shape == want.shape and not torch.allclose(got, want, atol=1e-5):
        for wrong, why in ((x @ expected.T, "the bias was not added: x @ Ŵᵀ + bias"),
                           (x @ expected.T + 2 * bias, "the bias was added twice"),
                           (x @ expected.T - bias, "the bias was subtracted: x @ Ŵᵀ + bias")):  # fmt: skip
            if torch.allclose(got, wrong, atol=1e-5):
                raise CheckFailed(f"Int4Linear(weight, {GROUP}, bias) on x[3, {IN}]: {why}")
    compare_tensors(got, want, f"Int4Linear(weight, {GROUP}, bias) on x[3, {IN}]", atol=1e-5)
    tensors = learner_function(layer.tensors)()
    if not any(isinstance(t, torch.Tensor) and t.shape == bias.shape and torch.equal(t.float(), bias)
               for t in tensors):  # fmt: skip
        raise CheckFailed("Int4Linear(weight, group_size, bias).tensors() does not list the bias: it lists everything "
                          "the layer keeps (the bias stays as it is: out numbers, too few to be worth packing)")  # fmt: skip
    half = call(x.bfloat16())
    if not isinstance(half, torch.Tensor) or half.dtype != torch.bfloat16:
        got = half.dtype if isinstance(half, torch.Tensor) else type(half).__name__
        raise CheckFailed(f"Int4Linear with a bias on bf16 activations returned {got}: add the bias in the "
                          "activations' dtype (bias.to(x.dtype))")  # fmt: skip


def _check_example(Int4Linear) -> None:
    refused = _check_refusals(Int4Linear)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(OUT, IN, generator=gen) * 0.05
    given = weight.clone()
    layer = Int4Linear(given, GROUP)
    if not torch.equal(given, weight):
        raise CheckFailed("Int4Linear changed the weight it was given in place: quantize a copy")
    held, packed = _held_bytes(layer), OUT * IN // 2
    numbers = 2 * (OUT * IN // GROUP) * 4  # a float32 scale and minimum per group
    allowed = packed + numbers + 64  # and a little slack
    if held >= OUT * IN * 4:
        raise CheckFailed(
            f"Int4Linear keeps {held} bytes for a {OUT}x{IN} weight: at least the float weight itself "
            f"({OUT * IN * 4} bytes). Keep only the packed values and the groups' scales and minima"
        )
    if held >= OUT * IN + numbers:
        raise CheckFailed(
            f"Int4Linear keeps {held} bytes for {OUT * IN} weights: a byte (or more) per weight. Pack two 4-bit values "
            "per byte, (q[:, 0::2] | q[:, 1::2] << 4) as uint8"
        )
    if held > allowed:
        raise CheckFailed(
            f"Int4Linear keeps {held} bytes; half a byte per weight and two numbers per group make {allowed}"
        )
    call = learner_function(layer.__call__)
    effective = call(torch.eye(IN)).T  # row i of I @ Ŵᵀ is Ŵ's column i
    expected = reference_weight(weight, GROUP)
    name_the_slip(effective, expected, ((reference_weight(weight, GROUP, m), why) for m, why in MISTAKES.items()), 1e-6)
    compare_tensors(effective, expected, f"the weight your Int4Linear multiplies by ({OUT}x{IN}, groups of {GROUP})",
                    atol=1e-6)  # fmt: skip
    x = torch.randn(3, 5, IN, generator=gen)
    compare_tensors(call(x), x @ expected.T, "Int4Linear on x[3, 5, 64] (any leading dims)", atol=1e-5)
    half = call(x.bfloat16())
    if not isinstance(half, torch.Tensor) or half.dtype != torch.bfloat16:
        got = half.dtype if isinstance(half, torch.Tensor) else type(half).__name__
        raise CheckFailed(f"Int4Linear on bf16 activations returned {got}: return the activations' dtype")
    _check_bias(Int4Linear, weight, expected, gen)
    _check_edges(Int4Linear, refused)


class LearnerInt4Method:
    """A weight method whose storage and matmul are a learner's ``Int4Linear`` (built from the
    layer's float weight, handed over because an int4 layer no longer holds it)."""

    name = "int4 (yours)"

    def __init__(self, cls, group_size: int, weight: torch.Tensor):
        self.cls, self.group_size, self.weight = cls, group_size, weight

    def process_weights(self, layer) -> None:
        layer.learner_int4 = learner_function(self.cls)(self.weight, self.group_size, layer.bias)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return learner_function(layer.learner_int4)(x)  # what it raises is the learner's, not the engine's

    def held_tensors(self, layer) -> list[torch.Tensor]:
        return list(learner_function(layer.learner_int4.tensors)())


def install(Int4Linear, int4_engine, plain_engine) -> int:
    """Give every int4 layer of ``int4_engine`` the learner's class as its method, built from the
    same layer's float weight in ``plain_engine``. Returns how many layers it replaced."""
    plain = dict(plain_engine.model.named_modules())
    count = 0
    for name, module in int4_engine.model.named_modules():
        method = getattr(module, "method", None)
        if method is not None and method.name == "int4":
            module.set_method(LearnerInt4Method(Int4Linear, method.group_size, plain[name].weight.detach()))
            count += 1
    return count


@check
def check_int4_linear(Int4Linear, model: str = "tiny-shakespeare-1m") -> str:
    """``Int4Linear(weight[out, in], group_size, bias=None)``: ``layer(x)`` and ``layer.tensors()``."""
    from minillm import LLM, SamplingParams

    _check_example(Int4Linear)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = ["ROMEO.\nBut soft, what light", "KING.\nNow is the winter"]
    args = dict(dtype="fp32", compile=False, enable_prefix_caching=False)
    engine = LLM(model, quantization="int4", **args)
    expected = [o.token_ids for o in engine.generate(prompts, params)]
    replaced = install(Int4Linear, engine, LLM(model, cpu_prepack=False, **args))
    got = [o.token_ids for o in engine.generate(prompts, params)]
    compare_requests(
        got,
        expected,
        "request {i} of the int4 engine with your Int4Linear in every int4 layer",
        "your layer matched on the example: what differs on the model's own shapes?",
    )
    return (
        f"your Int4Linear refused {len(REFUSED)} shapes it cannot store and activations of the wrong width, added a "
        f"bias in the activations' dtype, and ran all {replaced} int4 layers of the engine (half a byte per weight plus the groups' scales and minima), "
        "giving the package's int4 engine's greedy tokens"
    )
