"""HF Llama, eager attention, float64: one left-padded position turns every real position's logits into NaN.

    python examples/repro_llama_eager_float64.py

The departure of the suite's float64 twin that the conformance run notes for llama_eager (and llama_eager_bf16,
whose comparisons start on a float64 copy), reproduced without the suite: a left-padded prefill with
past_key_values goes NaN the same way. The model is correct in the precisions it ships in, so MODEL-PADDING and
MODEL-BATCHED-DECODING run there instead and pass (properties/model/twin.py; SPEC.md, "When the twin departs"). Cause: the eager path adds a mask of finfo(float64).min and
then takes softmax(..., dtype=torch.float32); cast to float32 that minimum is -inf, so the padded query at
column 0 (causal: its only key is itself, which is masked) gets a row of -inf and softmax returns NaN. In the
next layer the real queries give that padded key weight 0, and 0 * NaN = NaN. float32, and sdpa in either
dtype, are unaffected (prints False there).
"""
import torch
import transformers as t

torch.manual_seed(0)
model = t.LlamaForCausalLM(t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                         pad_token_id=0)).eval()
ids, mask = torch.tensor([[0, 5, 6, 7]]), torch.tensor([[0, 1, 1, 1]])   # one padded position, on the left
positions = (mask.cumsum(-1) - 1).clamp(min=0)
for attn in ("eager", "sdpa"):
    model.set_attn_implementation(attn)
    for dtype in (torch.float32, torch.float64):
        with torch.no_grad():
            logits = model.to(dtype)(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        print(f"{attn:5} {str(dtype):13} NaN at the real positions: {logits[0, 1:].isnan().any().item()}")
