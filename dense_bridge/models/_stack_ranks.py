"""Expert stacks whose matrices and biases one side keeps in one layer and the other in several.

transformers' GPT-OSS experts hold ``gate_up_proj`` (experts, hidden, 2 * ffn), its bias
(experts, 2 * ffn), ``down_proj`` and its bias in ONE layer; mlx-lm's ``SwitchGLU`` holds
``gate_proj``, ``up_proj`` and ``down_proj``, each a layer with a weight and a bias. In execution
order the two sequences of parameters alternate differently (matrix, bias, matrix, bias against
matrix, matrix, bias, bias), so the pairing parameter by parameter in order stops at once. Where it
leaves parameters on both sides, they pair again rank by rank: the matrices among themselves,
then the biases, each in execution order, by the same cuts and joins (``_infer._pair_stack_params``).
"""
from __future__ import annotations

__all__ = ["pair_by_rank"]


def pair_by_rank(left_a: list[str], left_b: list[str], shape_a, shape_b, pair) -> tuple[list[str], list[str]]:
    """Stack parameters left unpaired on both sides, paired again within each rank.

    Args:
        left_a: source parameter paths left, in execution order.
        left_b: destination parameter paths left, in execution order.
        shape_a: ``path -> stored shape`` on the source side.
        shape_b: ``path -> stored shape`` on the destination side.
        pair: ``(pa, pb) -> (left_a, left_b)`` pairing two lists of ``(path, shape)`` in order,
            recording its moves (``_infer._pair_stack_params`` bound to the plan).
    Returns:
        (source paths still unpaired, destination paths still unpaired); the inputs unchanged
        where a rank does not pair completely (the caller names them).
    """
    if not left_a or not left_b:
        return left_a, left_b
    pa = [(p, tuple(shape_a(p))) for p in left_a]
    pb = [(q, tuple(shape_b(q))) for q in left_b]
    ranks = sorted({len(s) for _, s in pa} | {len(s) for _, s in pb}, reverse=True)
    rest_a, rest_b = [], []
    for r in ranks:
        la, lb = pair([x for x in pa if len(x[1]) == r], [y for y in pb if len(y[1]) == r])
        rest_a += la
        rest_b += lb
    return rest_a, rest_b
