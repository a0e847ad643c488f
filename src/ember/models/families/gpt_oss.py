"""gpt-oss (OpenAI's gpt-oss-20b / 120b): a mixture-of-experts decoder with biased
attention projections, a learned attention sink per head (`self_attn.sinks`), a biased
router (`mlp.router`: top-k of the logits, softmax over the k chosen) and E experts fused
in biased 3-D weights stored (E, in, out): `mlp.experts.gate_up_proj` (E, H, 2I, gate and
up interleaved) and `mlp.experts.down_proj` (E, I, H); the published models alternate
sliding-window (128) and full-attention layers.

transformers has no SDPA kernel with sinks for it, so it loads with eager attention
(`attention`); its model builds attention masks without the position ids, so it does not
see packed sequences: the engine passes packed micro-batches their block-diagonal causal
mask itself (`packs_by_position=False`). The tiny model keeps every layer full-attention with a window as long
as its context (TorchSampler serves full-attention decoders; vLLM applies the window to
every other layer whatever `layer_types` says, which at that length changes nothing),
and YaRN with factor 1 (vLLM's gpt-oss reads YaRN's fields; at factor 1 it is plain RoPE).

Its tokenizer speaks harmony, as tinker-cookbook's gpt-oss renderer writes it:
`<|start|>role<|channel|>final<|message|>text<|return|>`, each marker a single token.
No tensor parallelism and no direct decode (the sampler runs the transformers forward).
"""

from __future__ import annotations

from transformers import GptOssConfig

from ember.models.families.base import LoraTargets, ModelFamily, MoeLayout, TinyChat

MOE = MoeLayout(router="mlp.router", num_experts="num_local_experts", transposed=True, router_softmax="top_k")

HARMONY_TOKENS = ("<|endoftext|>", "<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                  "<|return|>", "<|call|>", "<|constrain|>")
# A message is <|start|>{role}<|message|>{content}<|end|>; the prompt opens the final channel
# (the renderer writes the same markers; the template is for chat routes and tokenizer users).
HARMONY_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant<|channel|>final<|message|>' }}{% endif %}"
)
HARMONY = TinyChat(name="harmony", special=HARMONY_TOKENS, eos="<|return|>", template=HARMONY_TEMPLATE)


def tiny_config(**kwargs) -> GptOssConfig:
    """4 experts, 2 per token, expert width 3/4 of the hidden size (no square expert
    weight), every layer full attention (see the module docstring)."""
    hidden, layers = int(kwargs["hidden_size"]), int(kwargs["num_hidden_layers"])
    positions = int(kwargs["max_position_embeddings"])
    kwargs["intermediate_size"] = max(1, 3 * hidden // 4)
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": positions}
    return GptOssConfig(num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"] * layers,
                        sliding_window=positions, rope_parameters=rope, router_aux_loss_coef=0.0, **kwargs)


FAMILY = ModelFamily("gpt_oss", tiny_config=tiny_config, tp_plan=None, decode=None, moe=MOE, attention="eager",
                     packs_by_position=False,
                     lora=LoraTargets(mlp=(), experts=MOE.param_paths), tiny_chat=HARMONY,
                     value_head_class="GptOssForTokenClassification")
