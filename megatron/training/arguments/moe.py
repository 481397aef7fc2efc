"""Mixture-of-Experts flags (Megatron-LM's names and defaults) and the rules they must satisfy.

Why a module of its own: the MoE flags are one subject (megatron-core's MoE layer and expert
parallelism) that reads no other flag group but the parallel sizes; :mod:`.parser` registers
them with :func:`add_moe_args` and :mod:`.validation` runs :data:`RULES` in its order.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
from typing import Any, Callable, List, Tuple, Union

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
"""``--moe-router-load-balancing-type`` values (megatron-core 0.16.1's)."""


class _MoEFlagError(ValueError):
    """Raised by the rules here; :mod:`.validation` turns it into its ``ArgumentError``."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise _MoEFlagError(msg)


def _eval_int_list(node: ast.AST) -> Union[int, List[int]]:
    """An int or a list of ints built from list literals, ``+`` and ``*`` (nothing else runs)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_eval_int_list(e) for e in node.elts]
        if all(isinstance(i, int) for i in items):
            return items  # type: ignore[return-value]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_int_list(node.left), _eval_int_list(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int):
            return left * right
        if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, list):
            return right * left
    raise ValueError("not an int or a list of ints")


def moe_layer_freq(value: str) -> Union[int, List[int]]:
    """``--moe-layer-freq``: ``N`` (every N-th layer is MoE) or a 0/1 per layer in Megatron-LM's
    Python-list spelling, e.g. ``([0]*1+[1]*3)`` or ``[0,1,1,1]`` (parsed, not evaluated)."""
    text = value.strip()
    try:
        parsed = _eval_int_list(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{value!r}: give an int (every N-th layer is MoE) or a list of 0/1 per layer, "
            "e.g. ([0]*1+[1]*3)") from None
    if isinstance(parsed, int):
        if parsed < 1:
            raise argparse.ArgumentTypeError(f"{value!r}: the frequency must be >= 1")
        return parsed
    if any(v not in (0, 1) for v in parsed):
        raise argparse.ArgumentTypeError(f"{value!r}: a per-layer list holds 0 (dense) or 1 (MoE)")
    return parsed


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    """Register the MoE flags (a dense model without ``--num-experts``)."""
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None,
                   help="Experts per MoE layer (megatron-core's MoE layer; default: a dense model).")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="Ranks the experts of a layer are split over (expert parallelism, taken "
                        "out of the data-parallel ranks); expert weights and gradients are then "
                        "gathered and reduced over the expert-data-parallel group (DP / EP "
                        "ranks), quantized like the dense ones.")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="Tensor parallelism inside an expert: only --tensor-model-parallel-size "
                        "(the default) is supported.")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="Hidden size of each expert's MLP (default --ffn-hidden-size).")
    g.add_argument("--moe-router-topk", type=int, default=2,
                   help="Experts each token is routed to.")
    g.add_argument("--moe-router-load-balancing-type", choices=LOAD_BALANCING_TYPES,
                   default="aux_loss", help="The router's load-balancing method.")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="Weight of the load-balancing loss (logged as load_balancing_loss).")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None,
                   help="Weight of the router z-loss (logged as z_loss).")
    g.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"),
                   default="softmax")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="Softmax over all experts before the top-k (Mixtral's order is after).")
    g.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None,
                   help="Router computation dtype (default: the model's).")
    g.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall"),
                   default="allgather",
                   help="How tokens reach the experts of other expert-parallel ranks.")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="One grouped GEMM for a rank's experts (needs Transformer Engine or the "
                        "grouped_gemm package, on CUDA); otherwise megatron-core's sequential "
                        "expert MLPs.")
    g.add_argument("--moe-layer-freq", type=moe_layer_freq, default=1,
                   help="Which layers are MoE: N (every N-th) or a 0/1 list per layer, e.g. "
                        "([0]*1+[1]*3).")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="Hidden size of a shared expert every token also goes through.")
    g.add_argument("--moe-input-jitter-eps", type=float, default=None,
                   help="Multiplicative noise on the router input while training.")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="Tokens an expert takes, as a factor of its even share (default: no "
                        "limit, no token dropped).")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="Pad each expert's input to its capacity (with "
                        "--moe-expert-capacity-factor).")
    g.add_argument("--moe-token-drop-policy", choices=("probs", "position"), default="probs",
                   help="Which tokens an expert over capacity drops.")
    g.add_argument("--moe-per-layer-logging", action="store_true",
                   help="Log the load-balancing loss of each MoE layer too.")


# ----------------------------------------------------------------------------- rules
def expert_parallel_fits(args: argparse.Namespace) -> None:
    """EP divides the experts and the data-parallel ranks it is taken from."""
    ep = args.expert_model_parallel_size
    _require(ep >= 1, "--expert-model-parallel-size must be >= 1")
    if args.num_experts is None:
        _require(ep == 1, f"--expert-model-parallel-size {ep} needs --num-experts")
        return
    e = args.num_experts
    _require(e >= 1, "--num-experts must be >= 1")
    _require(e % ep == 0, f"--num-experts {e} is not divisible by --expert-model-parallel-size {ep}")
    _require(args.data_parallel_size % ep == 0,
             f"--expert-model-parallel-size {ep} does not divide the data-parallel size "
             f"{args.data_parallel_size} (world size {args.world_size} / (TP x PP)): expert-parallel "
             "ranks are taken out of the data-parallel ranks")
    etp = args.expert_tensor_parallel_size
    _require(etp is None or etp == args.tensor_model_parallel_size,
             f"--expert-tensor-parallel-size {etp}: only --tensor-model-parallel-size "
             f"({args.tensor_model_parallel_size}) is supported")
    _require(1 <= args.moe_router_topk <= e,
             f"--moe-router-topk {args.moe_router_topk} must be in [1, --num-experts {e}]")
    freq = args.moe_layer_freq
    if isinstance(freq, list):
        _require(len(freq) == args.num_layers,
                 f"--moe-layer-freq lists {len(freq)} layers, --num-layers is {args.num_layers}")


def moe_with_tensor_parallel_needs_sequence_parallel(args: argparse.Namespace) -> None:
    """megatron-core's MoE layer with TP > 1 splits tokens along the sequence."""
    if args.num_experts is not None and args.tensor_model_parallel_size > 1:
        _require(args.sequence_parallel,
                 "--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel "
                 "(megatron-core's MoE layer routes the sequence-parallel slice of the tokens)")


def alltoall_with_tensor_parallel_needs_nccl(args: argparse.Namespace) -> None:
    """With TP > 1 the alltoall dispatcher gathers uneven token counts over the TP ranks, which
    gloo's all_gather cannot do (NCCL can)."""
    if (args.num_experts is not None and args.tensor_model_parallel_size > 1
            and args.moe_token_dispatcher_type == "alltoall"):
        _require(args.distributed_backend != "gloo",
                 "--moe-token-dispatcher-type alltoall with --tensor-model-parallel-size "
                 f"{args.tensor_model_parallel_size} needs NCCL: megatron-core gathers the "
                 "tensor-parallel ranks' uneven token counts, which gloo cannot; on gloo (CPU) "
                 "use --moe-token-dispatcher-type allgather")


def default_moe_ffn_hidden_size(args: argparse.Namespace) -> None:
    """Each expert's MLP is --ffn-hidden-size wide unless --moe-ffn-hidden-size says otherwise."""
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size


def grouped_gemm_installed(args: argparse.Namespace) -> None:
    """--moe-grouped-gemm runs Transformer Engine's grouped GEMM where its layer spec is used, else
    megatron-core's GroupedMLP on the grouped_gemm package; both on CUDA only. Runs after the
    attention choice (``args.attention_impl``) is made."""
    if not getattr(args, "moe_grouped_gemm", False):
        return
    te_spec = getattr(args, "attention_impl", None) == "transformer_engine"
    package = "transformer_engine" if te_spec else "grouped_gemm"
    have = importlib.util.find_spec(package) is not None
    _require(args.device == "cuda" and have,
             f"--moe-grouped-gemm needs CUDA and the {package} package"
             + ("" if te_spec else " (the local layer spec's GroupedMLP; Transformer Engine's "
                "grouped GEMM runs with its spec, which --attention-backend local turns off)")
             + f": {'not installed' if not have else 'device cpu'}; leave it out to run "
             "megatron-core's sequential expert MLPs")


def capacity_flags_fit(args: argparse.Namespace) -> None:
    """Padding to capacity needs a capacity."""
    if args.moe_pad_expert_input_to_capacity:
        _require(args.moe_expert_capacity_factor is not None,
                 "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")


def shared_expert_without_bias(args: argparse.Namespace) -> None:
    """megatron-core's shared expert has no bias."""
    if args.num_experts is not None and args.moe_shared_expert_intermediate_size is not None:
        _require(not args.add_bias_linear,
                 "--moe-shared-expert-intermediate-size needs --disable-bias-linear "
                 "(megatron-core's shared expert has no biases)")


RULES: Tuple[Callable[[argparse.Namespace], None], ...] = (
    expert_parallel_fits, moe_with_tensor_parallel_needs_sequence_parallel,
    alltoall_with_tensor_parallel_needs_nccl,
    default_moe_ffn_hidden_size, grouped_gemm_installed, capacity_flags_fit,
    shared_expert_without_bias,
)
"""The MoE rules in their order (after the data-parallel size and --ffn-hidden-size are known)."""


def transformer_config_kwargs(args: argparse.Namespace) -> dict:
    """megatron-core ``TransformerConfig`` fields of the MoE flags (empty for a dense model;
    ``getattr``: namespaces saved before these flags existed build as before)."""
    if getattr(args, "num_experts", None) is None:
        return {}
    kwargs: dict = dict(
        num_moe_experts=args.num_experts,
        expert_model_parallel_size=args.expert_model_parallel_size,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_dtype=args.moe_router_dtype,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_grouped_gemm=args.moe_grouped_gemm,
        moe_layer_freq=args.moe_layer_freq,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_input_jitter_eps=args.moe_input_jitter_eps,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=args.moe_token_drop_policy,
        moe_per_layer_logging=args.moe_per_layer_logging,
    )
    return kwargs


def is_moe(args: Any) -> bool:
    """The run's model has MoE layers."""
    return getattr(args, "num_experts", None) is not None
