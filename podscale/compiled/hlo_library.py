"""XLA:GPU's calls into cuBLAS and cuDNN, read as the dot or convolution each one runs.

XLA:GPU runs most matrix products and convolutions not as ``dot`` and ``convolution`` instructions
but as ``custom-call``s into NVIDIA's libraries (the targets of XLA's ``cublas_cudnn.h``), at the
top level of a computation or wrapped in a fusion (a dynamic-slice fusion of a loop's stacked
weights). :func:`as_product` gives the ``dot`` or ``convolution`` such a call computes, in the
terms :mod:`podscale.compiled.hlo_cost` costs those instructions in; :func:`written_type`, the
results it writes (without its scratch workspace).

* cuBLAS (``__cublas$gemm``, ``__cublas$lt$matmul``, ``__cublas$lt$matmul$f8``): a dot of its first
  two operands (a bias, scales or an amax after them are not products), its dimension numbers
  those of the ``dot_dimension_numbers`` in its backend config (``"lhs_contracting_dimensions":
  ["1"]``, batch dimensions likewise), its result the first element of its result tuple.
* cuDNN (``__cudnn$convForward``, ``__cudnn$convBiasActivationForward``, ``__cudnn$convForwardGraph``,
  ``__cudnn$convBackwardInput``, ``__cudnn$convBackwardFilter``): a convolution with the call's
  ``window``, ``dim_labels`` and ``feature_group_count``, which XLA keeps as those of the forward
  convolution for the backward calls too. Its operands and result are mapped back to the forward
  convolution's, so that a backward call counts the FLOPs of the forward convolution it transposes
  (the same multiply-adds): a forward call reads (input, kernel, [bias, side input]) and writes
  the output; backward-input reads (output gradient, kernel) and writes the input's gradient;
  backward-filter reads (input, output gradient) and writes the kernel's gradient.

A call's result is a tuple whose last element is a ``u8``/``s8`` scratch workspace (``u8[0]`` when
it needs none): that is not data the op writes, and :func:`written_type` leaves it out.
"""

from __future__ import annotations

import re

GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
CONV_TARGETS = (
    "__cudnn$convForward",
    "__cudnn$convBiasActivationForward",
    "__cudnn$convForwardGraph",
    "__cudnn$convBackwardInput",
    "__cudnn$convBackwardFilter",
)
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_ARRAY = re.compile(r"\b[a-z][a-z0-9]*\[[\d,]*\](?:\{[^}]*\})?")
_WORKSPACE = re.compile(r"^[us]8\[")


def target(attrs: str) -> str:
    """A custom-call's ``custom_call_target`` (``""`` without one)."""
    m = _TARGET.search(attrs)
    return m.group(1) if m else ""


def is_library_call(opcode: str, attrs: str) -> bool:
    """Whether an instruction is a cuBLAS gemm or a cuDNN convolution (see the module docstring)."""
    return opcode == "custom-call" and target(attrs) in GEMM_TARGETS + CONV_TARGETS


def _arrays(type_text: str) -> list[str]:
    return _ARRAY.findall(type_text)


def _results(type_text: str) -> list[str]:
    """The arrays a library call writes: its result tuple's, less the trailing workspace."""
    results = _arrays(type_text)
    if type_text.lstrip().startswith("(") and len(results) > 1 and _WORKSPACE.match(results[-1]):
        results = results[:-1]
    return results


def written_type(opcode: str, type_text: str, attrs: str) -> str:
    """The type of the results an instruction writes: a library call's without its workspace, any
    other instruction's as it is."""
    if not is_library_call(opcode, attrs):
        return type_text
    results = _results(type_text)
    return results[0] if len(results) == 1 else "(" + ", ".join(results) + ")"


def _dims(attrs: str, key: str) -> str:
    m = re.search(rf'\\?"{key}\\?"\s*:\s*\[([^\]]*)\]', attrs)
    return ",".join(re.findall(r"\d+", m.group(1))) if m else ""


def as_product(opcode: str, type_text: str, operand_types: list[str], attrs: str) -> tuple | None:
    """(opcode, result type, operand types, attributes) of the ``dot`` or ``convolution`` a cuBLAS
    or cuDNN custom-call computes, in HLO's own terms; ``None`` for any other instruction (see the
    module docstring)."""
    if opcode != "custom-call":
        return None
    name = target(attrs)
    results = _results(type_text)
    operands = [a for t in operand_types for a in _arrays(t)]
    if not results or len(operands) < 2:
        return None
    if name in GEMM_TARGETS:
        if not re.search(r'\\?"lhs_contracting_dimensions\\?"', attrs):
            return None
        keys = ("lhs_batch", "lhs_contracting", "rhs_batch", "rhs_contracting")
        dims = ", ".join(f"{k}_dims={{{_dims(attrs, k + '_dimensions')}}}" for k in keys)
        return "dot", results[0], operands[:2], dims
    if name in CONV_TARGETS:
        if name == "__cudnn$convBackwardInput":  # (output grad, kernel) -> input grad
            out, lhs, kernel = operands[0], results[0], operands[1]
        elif name == "__cudnn$convBackwardFilter":  # (input, output grad) -> kernel grad
            out, lhs, kernel = operands[1], operands[0], results[0]
        else:  # (input, kernel, [bias, side input, scales]) -> output
            out, lhs, kernel = results[0], operands[0], operands[1]
        return "convolution", out, [lhs, kernel], attrs
    return None
