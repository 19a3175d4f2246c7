"""The bug catalog: deliberately broken implementations, one realistic bug each, and the correct ones.

``CATALOG`` lists every broken implementation at three levels — kernels (``kernels.py``, SDPA signature,
plugged in with ``--kernel``), modules (``modules.py``, zoo parts replaced through ``_target_`` with
``--zoo``) and models (``models.py``, factories for ``--model``) — with its mechanism and the spec clauses
(``properties/SPEC.md``) whose statements it violates (``decode_bugs.py``, ``differential.py`` and ``scale_bugs.py`` hold
more model bugs: decode paths, fast models against a reference, bugs that hide below a length). ``CORRECT`` lists implementations that must pass
with zero failures. ``python -m properties.catalog.mutation_report`` runs the suite on all of them;
``tests/test_catalog.py`` checks the same in CI.

    pytest properties/ --kernel properties.catalog.kernels:causal_off_by_one
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from properties.core.levels import LEVELS

__all__ = ["Entry", "CATALOG", "CORRECT", "LEVELS", "by_name"]

_K, _M, _Z = "properties.catalog.kernels", "properties.catalog.modules", "properties.catalog.models"
_B = "properties.catalog.backward"
_FA = "properties.catalog.flash_bugs"
_TB, _TILED = "properties.catalog.tile_bugs", "properties.catalog.tiled"
_CB = "properties.catalog.contract_bugs"
_FLASH_OPTIONS = ("--kernel-api=flash", "--kernel-api=flash-varlen", "--kernel-api=flash-kvcache")


@dataclass(frozen=True)
class Entry:
    """One implementation under test, plugged in as a user would: ``pytest properties/ OPTION ARGUMENT``.

    level: kernel | module | model — which clauses concern it (the suite's kernel, module or model tests).
    expected: clause IDs whose statements the bug violates (empty for a correct implementation).
    """
    name: str
    level: str
    mechanism: str
    expected: tuple[str, ...]
    option: str       # --kernel | --zoo | --model ("" for the plain run on the zoo's own parts)
    argument: str
    extra: tuple[str, ...] = ()   # further words after OPTION ARGUMENT, e.g. ("--reference", "pkg.module:factory")

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"Entry {self.name}: level {self.level!r} not in {LEVELS}")
        # "": no plug-in option (the zoo itself); "--kernel-api=API" (argument "--kernel=SPEC"): a kernel with
        # FlashAttention's API API; "--kernel-api" (argument API): the zoo's own kernels of that API.
        if self.option not in ("--kernel", "--zoo", "--model", "", "--kernel-api", *_FLASH_OPTIONS):
            raise ValueError(f"Entry {self.name}: option {self.option!r}")
        if self.option in _FLASH_OPTIONS and not self.argument.startswith("--kernel="):
            raise ValueError(f"Entry {self.name}: {self.option} takes the argument '--kernel=SPEC'")

    @property
    def needs_source_tree(self) -> bool:
        """An ``examples/file.py:factory`` path: only available in a checkout of the repository."""
        return self.option == "--model" and self.argument.split(":")[0].endswith(".py")

    @property
    def plug_in(self) -> list[str]:
        """The command-line words that plug the implementation in."""
        return ([self.option, self.argument] if self.option else []) + list(self.extra)

    def resolved_argument(self, root: Path | None) -> str | None:
        """The argument with a relative ``.py`` path made absolute against ``root`` (None if absent)."""
        if not self.needs_source_tree:
            return self.argument
        path, _, name = self.argument.rpartition(":")
        if root is None or not (root / path).is_file():
            return None
        return f"{root / path}:{name}"


def _kernel(name, mechanism, *expected):
    return Entry(name, "kernel", mechanism, expected, "--kernel", f"{_K}:{name}")


def _backward(name, *expected):
    from properties.catalog.backward import BUGS
    return Entry(name, "kernel", f"exact forward, wrong backward: {BUGS[name]}", expected, "--kernel", f"{_B}:{name}")


def _flash(name):
    """A FlashAttention-API bug of flash_bugs.py, plugged in as ``--kernel-api=API --kernel=SPEC``; the entry's
    name says flash (``-k flash`` selects them all)."""
    from properties.catalog.flash_bugs import BUGS
    api, mechanism, expected = BUGS[name]
    return Entry(name if "flash" in name else f"flash_{name}", "kernel", mechanism, expected, f"--kernel-api={api}",
                 f"--kernel={_FA}:{name}")


def _tile(name):
    """A tile-boundary bug of tile_bugs.py: exact on one 64 x 64 tile, caught on the pinned kernel-scale problems."""
    from properties.catalog.tile_bugs import BUGS
    mechanism, expected = BUGS[name]
    return Entry(name, "kernel", mechanism, expected, "--kernel", f"{_TB}:{name}")


_SB_STATE = "properties.catalog.state_bugs"


def _state(name):
    """An online-softmax state bug of state_bugs.py: caught by extreme scores, masked tiles or long rows."""
    from properties.catalog.state_bugs import BUGS
    mechanism, expected = BUGS[name]
    if name.endswith("_flash"):
        return Entry(name, "kernel", mechanism, expected, "--kernel-api=flash", f"--kernel={_SB_STATE}:{name}")
    return Entry(name, "kernel", mechanism, expected, "--kernel", f"{_SB_STATE}:{name}")


def _module(name, mechanism, overrides, *expected):
    return Entry(name, "module", mechanism, expected, "--zoo", overrides)


def _model(name, mechanism, *expected):
    return Entry(name, "model", mechanism, expected, "--model", f"{_Z}:{name}")


_DB, _DIFF = "properties.catalog.decode_bugs", "properties.catalog.differential"


def _decode_bug(name):
    """A model whose cached decoding of a left-padded batch is wrong and whose forward pass is right."""
    from properties.catalog.decode_bugs import BUGS
    return Entry(name, "model", BUGS[name], ("MODEL-BATCHED-DECODING",), "--model", f"{_DB}:{name}")


_SB = "properties.catalog.scale_bugs"


def _scale_bug(name):
    """A model exact below a length by construction and wrong past it (scale_bugs.py)."""
    from properties.catalog.scale_bugs import BUGS
    mechanism, expected = BUGS[name]
    return Entry(name, "model", mechanism, expected, "--model", f"{_SB}:{name}")


_IB = "properties.catalog.integrity_bugs"


def _integrity() -> list[Entry]:
    """Integrity, history and layout bugs (integrity_bugs.py): exact on every problem called first on fresh
    contiguous inputs."""
    from properties.catalog.integrity_bugs import KERNEL_BUGS, MODEL_BUGS
    return ([Entry(name, "kernel", mechanism, expected, "--kernel", f"{_IB}:{name}")
             for name, (mechanism, expected) in KERNEL_BUGS.items()]
            + [Entry(name, "model", mechanism, expected, "--model", f"{_IB}:{name}")
               for name, (mechanism, expected) in MODEL_BUGS.items()])


_MOE = "properties.catalog.moe_bugs"


def _moe_bug(name):
    """A transformers MoE model whose router gets one line wrong (moe_bugs.py)."""
    from properties.catalog.moe_bugs import BUGS
    return Entry(name, "model", BUGS[name], ("MODEL-ROUTING",), "--model", f"{_MOE}:{name}")


def _fast(name, *expected):
    """A "fast" model that differs from its reference (differential.reference: the same weights, the zoo's math)."""
    from properties.catalog.differential import BUGS
    return Entry(name, "model", BUGS[name], expected, "--model", f"{_DIFF}:{name}", ("--reference", f"{_DIFF}:reference"))


CATALOG: list[Entry] = [
    # ------------------------------------------------------------------------------------------ kernels
    _kernel("softmax_over_queries", "softmax normalizes over the query axis (dim=-2), not the keys",
            "ATTN-ROWSUM", "ATTN-ORACLE"),
    _kernel("scale_missing", "the 1/sqrt(d_k) factor forgotten (scale=None treated as 1)",
            "SCALE-DEFAULT", "SCALE-VARIANCE", "ATTN-ORACLE"),
    _kernel("scale_inverted", "multiplies by sqrt(d_k) instead of dividing",
            "SCALE-DEFAULT", "SCALE-VARIANCE", "ATTN-ORACLE"),
    _kernel("scale_applied_twice", "q pre-scaled and the scores scaled again: sigma^2 = 1/d_k",
            "SCALE-DEFAULT", "SCALE-EXPLICIT", "SCALE-VARIANCE", "ATTN-ORACLE"),
    _kernel("scale_by_model_width", "divides by sqrt(d_model) = sqrt(H*E) instead of sqrt(d_k)",
            "SCALE-DEFAULT", "ATTN-ORACLE"),
    _kernel("scale_by_value_width", "divides by sqrt(d_v) (value.size(-1)) instead of sqrt(d_k)",
            "SCALE-DEFAULT", "ATTN-ORACLE"),
    _kernel("scale_by_head_count", "head size read from dim 1, the head count in (B, H, L, E)",
            "SCALE-DEFAULT", "ATTN-ORACLE"),
    _kernel("scale_argument_ignored", "the scale= keyword accepted and ignored (always 1/sqrt(E))",
            "SCALE-EXPLICIT"),
    _kernel("scores_in_input_dtype", "(q @ k^T) * scale in the input dtype, no upcast: the unscaled product overflows",
            "ATTN-LARGE-SCORES"),
    _kernel("softmax_without_max", "exp(s)/sum exp(s) without subtracting the row max: overflow to inf/inf = NaN",
            "ATTN-LARGE-SCORES", "ATTN-SHIFT-INVARIANT"),
    _kernel("causal_off_by_one", "causal mask tril(diagonal=1): each query also sees the next key",
            "CAUSAL-NO-FUTURE", "CAUSAL-ZERO-ABOVE", "CAUSAL-ALIGNMENT"),
    _kernel("causal_ignored", "is_causal accepted and never applied",
            "CAUSAL-NO-FUTURE", "CAUSAL-ZERO-ABOVE", "CAUSAL-ALIGNMENT"),
    _kernel("causal_bottom_right", "causal diagonal aligned bottom-right (FlashAttention >= 2.1) under PyTorch's top-left contract",
            "CAUSAL-ALIGNMENT", "CAUSAL-NO-FUTURE", "CAUSAL-ZERO-ABOVE"),
    _kernel("bool_mask_inverted", "bool mask read as True = masked (nn.MultiheadAttention's polarity)",
            "MASK-BOOL", "MASK-BOOL-FLOAT", "MASK-NO-INFLUENCE", "MASK-BROADCAST"),
    _kernel("float_mask_ignored", "only bool masks handled: an additive float mask is dropped",
            "MASK-FLOAT-ADDITIVE", "MASK-BOOL-FLOAT", "MASK-LOW-PRECISION", "MASK-BROADCAST"),
    _kernel("mask_after_softmax", "masked weights zeroed after the softmax: rows no longer sum to 1",
            "MASK-BOOL", "MASK-BOOL-FLOAT", "ATTN-ROWSUM", "CAUSAL-ALIGNMENT", "MASK-BROADCAST"),
    _kernel("fully_masked_rows_nan", "plain softmax over an all -inf row: NaN instead of zeros",
            "MASK-FULLY-MASKED"),
    _kernel("finite_mask_fill", "-1e4 added to masked scores (BERT's extended mask) instead of -inf: masked keys keep weight",
            "MASK-NO-INFLUENCE", "CAUSAL-NO-FUTURE", "MASK-FULLY-MASKED"),
    _kernel("mask_added_in_input_dtype", "float mask added after casting the scores back to float16: score + finfo.min overflows to -inf",
            "MASK-LOW-PRECISION"),
    _kernel("masked_fill_minus_1e9", "masked_fill(mask == 0, -1e9) (The Annotated Transformer): fully masked rows average the values",
            "MASK-FULLY-MASKED", "MASK-NO-INFLUENCE"),
    _kernel("dropout_always_on", "dropout with a fixed p = 0.1 whatever dropout_p says (also at inference)",
            "DROPOUT-OFF", "DROPOUT-RATE", "ATTN-ORACLE"),
    _kernel("dropout_not_rescaled", "kept weights not rescaled by 1/(1 - p): the expected output shrinks",
            "DROPOUT-EXPECTATION"),
    _kernel("dropout_mask_shared", "one (L, S) dropout mask broadcast over batch and heads: drops not independent",
            "DROPOUT-EXPECTATION", "DROPOUT-RATE", "DROPOUT-INDEPENDENT"),
    _kernel("dropout_mask_shared_across_heads", "4-D dropout whose RNG offset advances per batch entry, not per head: "
            "every head drops the same weights", "DROPOUT-INDEPENDENT"),
    _kernel("batch_and_heads_mixed", "k, v flattened head-major, q batch-major: slices attend to other slices' keys",
            "ATTN-SLICE-INDEPENDENT", "ATTN-ORACLE"),
    _kernel("flash_attention_tiles_dropped", "tiled online softmax with S // block key tiles: the last partial tile is lost",
            "ATTN-ORACLE", "ATTN-ROWSUM"),
    _kernel("gqa_heads_tiled", "kv heads expanded with repeat (head i mod H_kv), not repeat_interleave",
            "GQA-HEADS"),
    # ------------------------------------- declared contracts (--deterministic, --batch-invariant): accurate kernels
    Entry("atomic_order_attention", "kernel", "key blocks' partial sums added in an order that changes with every call "
          "(atomic adds)", ("KERNEL-DETERMINISTIC",), "--kernel", f"{_CB}:atomic_order_attention", ("--deterministic",)),
    Entry("split_by_batch_attention", "kernel", "split-K over the keys with the split count chosen from B x H",
          ("KERNEL-BATCH-INVARIANT",), "--kernel", f"{_CB}:split_by_batch_attention", ("--batch-invariant",)),
    _kernel("output_in_compute_dtype", "the float32 accumulator returned for half inputs (cast back forgotten)",
            "ATTN-SHAPE"),
    # ------------------------------------------------------- kernels with a correct forward and a wrong backward
    _backward("dq_unscaled", "ATTN-GRAD", "ATTN-GRAD-DROPOUT"),
    _backward("dk_unscaled", "ATTN-GRAD", "ATTN-GRAD-DROPOUT"),
    _backward("rowsum_term_dropped", "ATTN-GRAD", "ATTN-GRAD-DROPOUT"),
    _backward("causal_missing_in_backward", "ATTN-GRAD", "ATTN-GRAD-CAUSAL"),
    _backward("dropout_not_reapplied", "ATTN-GRAD-DROPOUT"),
    _backward("nan_for_fully_masked_rows", "ATTN-GRAD-MASKED"),
    _backward("gqa_kv_gradient_not_summed", "ATTN-GRAD", "ATTN-GRAD-GQA"),
    _backward("float_mask_gradient_before_softmax", "ATTN-GRAD"),
    _backward("assumes_contiguous_grad_out", "ATTN-GRAD"),
    # ------------------------------------------ tile-boundary bugs: exact on one 64 x 64 tile, forward or backward
    *(_tile(name) for name in (
        "accumulator_not_rescaled", "row_sum_not_rescaled", "remainder_key_tile_dropped", "causal_row_inside_tile",
        "head_halves_one_unscaled", "query_remainder_unwritten", "mask_tile_local_columns", "lse_of_last_tile_saved",
        "dk_dv_last_partial_tile_dropped", "dq_overwritten_per_key_tile")),
    # ----------------------------- online-softmax state: very negative rows, masked 64-key tiles, precision at length
    *(_state(name) for name in ("running_max_sentinel", "masked_tile_resets_max", "state_rounded_per_tile",
                                "running_max_sentinel_flash")),
    # ------------------------------------ kernels with FlashAttention's API (--kernel-api flash|flash-varlen|...)
    *(_flash(name) for name in (
        "window_left_off_by_one", "window_right_off_by_one", "window_sides_swapped", "window_top_left",
        "causal_top_left", "softcap_after_mask", "softcap_before_scale", "softcap_after_alibi", "alibi_sign_flipped",
        "alibi_distance_top_left", "alibi_without_abs", "alibi_batch_row_ignored", "gqa_heads_tiled_flash",
        "fully_masked_rows_nan_flash", "backward_without_window", "softcap_backward_as_uncapped",
        "varlen_reads_one_key_past_the_end",
        "varlen_cross_sequence_leak", "varlen_causal_global_offset", "varlen_alibi_row0",
        "varlen_backward_across_sequences",
        "kvcache_seqlens_off_by_one", "kvcache_stale_slots_attended", "kvcache_append_off_by_one",
        "kvcache_paged_block_table_ignored", "kvcache_batch_idx_ignored_on_read", "kvcache_leftpad_ignored",
        "kvcache_causal_top_left")),
    # ------------------------------------------------------------------------------------------ modules
    _module("split_heads_without_transpose", "heads split with view(b, h, l, e) instead of view(b, l, h, e).transpose",
            f"attention._target_={_M}.SplitHeadsWithoutTranspose", "MHA-ORACLE", "MHA-PERMUTATION"),
    _module("merge_heads_transposed", "heads merged as (e h) while split as (h e): W^O reads the wrong columns",
            f"attention._target_={_M}.MergeHeadsTransposed", "MHA-ORACLE"),
    _module("gqa_heads_interleaved", "grouped kv heads tiled (head i mod k) instead of repeat_interleave (i // g)",
            f"attention._target_={_M}.GqaHeadsInterleaved", "MHA-GQA"),
    _module("attention_scale_by_model_width", "the module passes scale = 1/sqrt(d_model) instead of 1/sqrt(d_model/h)",
            f"attention._target_={_M}.ScaleByModelWidth", "MHA-ORACLE", "MHA-SINGLE-HEAD"),
    _module("layernorm_over_positions", "LayerNorm statistics over the positions (dim 1), not each token's features",
            f"norm._target_={_M}.LayerNormOverPositions", "NORM-PER-TOKEN", "NORM-STANDARDIZE"),
    _module("ffn_without_activation", "the activation between the two linear maps forgotten",
            f"ffn._target_={_M}.FeedForwardWithoutActivation", "FFN-FORMULA"),
    _module("gelu_tanh_for_exact", "GELU's tanh approximation where the config says exact GELU",
            f"ffn=gelu ffn._target_={_M}.GeluTanhForExact", "FFN-FORMULA"),
    _module("sin_cos_swapped", "cos on the even features and sin on the odd ones",
            f"pos._target_={_M}.SinCosSwapped", "POS-SINUSOID-FORMULA"),
    _module("frequency_exponent_doubled", "exponent 2*(2i)/d: the even index arange(0, d, 2) doubled again",
            f"pos._target_={_M}.FrequencyExponentDoubled", "POS-SINUSOID-FORMULA", "POS-SINUSOID-WAVELENGTHS"),
    _module("residual_missing", "post-norm sub-layers without the residual: Norm(Sublayer(x))",
            f"model=encoder_decoder model._target_={_M}.NoResidualEncoderDecoder", "LAYER-RESIDUAL",
            "LAYER-POST-NORM"),
    _module("residual_of_normed_input", "pre-norm residual carries the normalized input: h = Norm(x); h + Sublayer(h)",
            f"model=encoder_decoder norm_placement=pre model._target_={_M}.NormedResidualEncoderDecoder",
            "LAYER-PRE-NORM", "LAYER-RESIDUAL"),
    _module("layernorm_backward_mean_term_dropped", "hand-written LayerNorm backward without the mean(g·dy) term",
            f"norm=layernorm norm._target_={_M}.LayerNormMeanTermDropped", "NORM-GRAD"),
    _module("ffn_down_weight_detached", "the second linear map applied with a detached weight (W2 gets no gradient)",
            f"ffn._target_={_M}.FeedForwardDownDetached", "FFN-GRAD"),
    # ------------------------------------------------------------------------------------------- models
    _model("no_causal_mask", "the decoder's self-attention never receives is_causal",
           "MODEL-CAUSAL", "MODEL-FACTORISATION", "MODEL-KV-CACHE"),
    _model("causal_mask_dropped_with_padding", "the causal mask is built only without a padding mask (one condition lost)",
           "MODEL-CAUSAL", "MODEL-PADDING", "MODEL-KV-CACHE"),
    _model("query_padding_mask", "the padding mask applied to the queries (output rows) instead of the keys",
           "MODEL-PADDING"),
    _model("padding_mask_inverted", "padding mask passed in torch.nn's polarity (True = ignore): real keys masked",
           "MODEL-PADDING"),
    _model("cross_attends_to_decoder", "cross-attention attends over the decoder's own states, not the encoder's",
           "MODEL-DEPENDENCE"),
    _model("memory_padding_mask_dropped", "cross-attention called without the source padding mask",
           "MODEL-PADDING"),
    _model("dropout_in_eval", "F.dropout(..., training=True) hard-coded: dropout active in eval mode",
           "MODEL-DETERMINISM"),
    _model("batch_statistics_norm", "BatchNorm-style statistics over the batch and positions instead of per token",
           "MODEL-BATCH", "MODEL-PADDING"),
    _model("cache_offset_ignored", "positions restart at 0 in every cached decoding step (offset ignored)",
           "MODEL-KV-CACHE"),
    _model("positions_not_added", "position codes computed but never added to the embeddings",
           "MODEL-PERMUTATION"),
    # ------------------------- decode-path bugs (MODEL-BATCHED-DECODING) and fast models vs a reference (MODEL-DIFF-*)
    *(_decode_bug(name) for name in ("one_token_positions_from_columns", "one_token_step_attends_padding",
                                     "cache_keeps_last_block", "long_chunk_causal_top_left")),
    _fast("softmax_scale_off", "MODEL-DIFF-FORWARD", "MODEL-DIFF-GRADIENT", "MODEL-DIFF-DECODE"),
    _fast("attention_bias_dropped", "MODEL-DIFF-FORWARD", "MODEL-DIFF-GRADIENT", "MODEL-DIFF-DECODE"),
    _fast("one_layer_wrong_backward", "MODEL-DIFF-GRADIENT"),
    _fast("split_kv_decode_drops_last_block", "MODEL-DIFF-DECODE"),
    # ------------------------------------------------- at-scale model bugs, exact below a length (MODEL-SHIFT, ...)
    *(_scale_bug(name) for name in ("rotary_positions_in_bf16", "window_admits_one_more", "cache_keeps_last_100",
                                    "alibi_positions_clamped", "position_table_clamped")),
    # ------------------------------------ integrity, history and layouts (inputs, outputs, earlier calls, strides)
    *_integrity(),
    # -------------------------------- models whose layers differ, and mixture-of-experts routing (MODEL-WINDOW, ...)
    _model("local_window_one_more", "a window of 4 that admits 5 keys, in the windowed layers of a model whose "
           "windowed and global layers alternate (the global ones hide it from the outputs)", "MODEL-WINDOW"),
    *(_moe_bug(name) for name in ("router_softmax_over_tokens", "renormalized_against_config")),
]

# ------------------------------------------------------------------------ pair bugs (the covering schedule, issue 40)
# Kernels a line or two from a correct one, exact on every problem that holds one of two classes and wrong on those
# that hold both (pair_bugs.py). Caught by the covering rows of their clauses, at the pinned profile too.
_PB = "properties.catalog.pair_bugs"


def _pair_bug(name):
    from properties.catalog.pair_bugs import BUGS
    mechanism, pair, expected = BUGS[name]
    return Entry(name, "kernel", f"{mechanism} (needs {pair})", expected, "--kernel", f"{_PB}:{name}")


CATALOG += [_pair_bug(name) for name in (
    "query_tiles_from_key_length", "causal_positions_in_input_dtype", "causal_dropped_for_head_size_256",
    "float_mask_rows_fixed_in_place", "grouped_kv_memoized_by_address", "keys_memoized_by_address_past_64",
    "rows_without_key_nan_in_half", "scale_ignored_at_head_size_256", "dropout_repeats_per_tile",
    "strided_tail_tile_read_contiguous", "split_keys_without_empty_guard", "accumulator_sized_by_e_at_256",
    "mask_heads_read_by_kv_head", "tile_skipped_by_its_first_row")]
# ------------------------------------------------------------------------------------------- end of pair bugs

_MHA = "properties.catalog.correct.TorchMultiheadAttention"
CORRECT: list[Entry] = [
    Entry("F.scaled_dot_product_attention", "kernel", "PyTorch's SDPA", (), "--kernel",
          "torch.nn.functional:scaled_dot_product_attention"),
    Entry("zoo math", "kernel", "the zoo's einsum kernel", (), "--kernel", "math"),
    Entry("zoo torch", "kernel", "the zoo's backend calling F.scaled_dot_product_attention", (), "--kernel", "torch"),
    Entry("stepwise", "kernel", "correct.StepwiseAttention (the broken kernels' base)", (), "--kernel",
          "properties.catalog.correct:stepwise_attention"),
    Entry("flash", "kernel", "FlashAttention's tiled online softmax in plain torch", (), "--kernel",
          "properties.catalog.correct:flash_attention"),
    Entry("autograd.Function", "kernel", "a hand-written backward over materialised weights", (), "--kernel",
          f"{_B}:straightforward"),
    Entry("zoo memory_efficient", "kernel", "the zoo's FlashAttention-2 style kernel with its own backward", (),
          "--kernel", "memory_efficient"),
    Entry("zoo flash-API kernels", "kernel", "zoo/nn/flash.py: reference, tiled, varlen loop and packed, kvcache "
          "gather and paged", (), "--kernel-api", "flash"),
    Entry("memory_efficient, blocks of 3", "kernel", "the same with 3-key blocks (S/8 past 24 keys): every block "
          "path runs", (),
          "--kernel", "properties.catalog.correct:memory_efficient_block3"),
    Entry("tiled", "kernel", "FlashAttention-2 in plain torch, tiles of 64, its own backward (the tile bugs' base)",
          (), "--kernel", f"{_TILED}:tiled_attention"),
    Entry("tiled, a fused kernel's limits", "kernel", "the same declining float32/float64, masks, head sizes other "
          "than 16/32/64/128 and L != S", (), "--kernel", f"{_TILED}:fused_limits"),
    Entry("flash in the zoo", "module", "the zoo's attention on the flash kernel", (), "--zoo",
          "attention.kernel=properties.catalog.correct:flash_attention"),
    Entry("nn.MultiheadAttention", "module", "torch.nn.MultiheadAttention as the zoo's attention", (), "--zoo",
          f"attention._target_={_MHA} ~attention.kernel attention.kv_heads=1 ~attention.kv_heads"),
    Entry("nn.MultiheadAttention (enc-dec)", "module", "torch.nn.MultiheadAttention in an encoder-decoder", (),
          "--zoo", f"model=encoder_decoder attention._target_={_MHA} ~attention.kernel attention.kv_heads=1 ~attention.kv_heads"),
    Entry("nn.TransformerEncoder", "model", "examples/torch_nn.py", (), "--model", "examples/torch_nn.py:encoder"),
    Entry("nn.Transformer", "model", "examples/torch_nn.py", (), "--model", "examples/torch_nn.py:transformer"),
    Entry("HF GPT-2", "model", "examples/huggingface.py", (), "--model", "examples/huggingface.py:gpt2"),
    Entry("HF BERT", "model", "examples/huggingface.py", (), "--model", "examples/huggingface.py:bert"),
    Entry("HF BART", "model", "examples/huggingface.py", (), "--model", "examples/huggingface.py:bart"),
    Entry("HF-style decoder", "model", "decode_bugs.TinyLM, the model the decode-path bugs vary", (), "--model",
          f"{_DB}:tiny_lm"),
    Entry("alternating windows", "model", "the tiny zoo decoder, a window of 4 in its even layers and none in its odd "
          "ones (the model local_window_one_more varies)", (), "--model", f"{_Z}:alternating_windows"),
    Entry("HF Mixtral", "model", "transformers' Mixtral, 4 experts, top 2 (the model the routing bugs vary)", (),
          "--model", f"{_MOE}:mixtral"),
    Entry("HF-style decoder at scale", "model", "scale_bugs.ScaleLM in bfloat16, rotary, a window of 16, max_len "
          "1280: the model the at-scale bugs vary", (), "--model", f"{_SB}:scale_lm"),
    Entry("memory_efficient vs math", "model", "the zoo's memory-efficient kernel (16-key blocks) against the math "
          "kernel, the same weights", (), "--model", f"{_DIFF}:memory_efficient", ("--reference", f"{_DIFF}:reference")),
    Entry("torch vs math (enc-dec)", "model", "an encoder-decoder on PyTorch's SDPA against the math kernel, the same "
          "weights", (), "--model", f"{_DIFF}:torch_encoder_decoder", ("--reference", f"{_DIFF}:reference")),
]


def by_name(name: str) -> Entry:
    for entry in CATALOG + CORRECT:
        if entry.name == name:
            return entry
    raise KeyError(name)
