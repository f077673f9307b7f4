"""Tiny random-init instances of every causal LM the installed transformers maps (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
for tests/python/test_hf_patch.py.

Each is built from its own config class with the small sizes below (given only where the config has the field)
and the few per-architecture fields its validation or its layer pattern needs. Entries that are not a text
decoder of their own (composite multimodal configs, whose text model is an entry of its own; decoders of
encoder-decoder models) are skipped with the reason.
"""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Tuple

import torch

# Sizes every architecture gets where its config has the field: hidden 64, 2 layers, 4 heads of 16, vocabulary 256.
SMALL = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=256, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, use_cache=False,
    # mixtures of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, expert_intermediate_size=32, n_shared_experts=1,
    # multi-head latent attention (DeepSeek V2/V3 and kin)
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
    # partial rotary (GPT-J, CodeGen)
    rotary_dim=8,
    # state-space and linear-attention layers (their CPU paths cost time in the state and chunk sizes)
    mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_d_ssm=128, mamba_chunk_size=16, mamba_dt_rank=8,
    chunk_size=16, linear_head_dim=16, linear_num_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, swa_num_attention_heads=4, swa_num_key_value_heads=2,
    swa_head_dim=16, ple_embed_dim=16,
    # what happens to the logits and the loss after the head, set where the model has it so that it shows:
    # a softcap that bites at this vocabulary, Granite's logit divisor, the routers' auxiliary loss
    final_logit_softcapping=5.0, logits_scaling=4.0, lm_head_multiplier=0.5, output_router_logits=True,
    router_aux_loss_coef=0.1,
)

# What some architectures need beyond SMALL: a layer pattern with an attention layer among two, group counts that
# divide the experts, sizes their validation ties together.
ONE_OF_EACH = object()  # for layer_types in EXTRA
EXTRA: Dict[str, dict] = {
    "axk1": dict(n_group=1, topk_group=1),
    "cohere_compass_text": dict(layer_types=ONE_OF_EACH,
                                rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0)}),
    # Their forward fails with output_router_logits=True in transformers 5.24 (with or without the patch).
    "deepseek_v4": dict(output_router_logits=None),
    "flint": dict(output_router_logits=None),
    "gemma3n_text": dict(layer_types=ONE_OF_EACH, num_kv_shared_layers=0, vocab_size_per_layer_input=256, hidden_size_per_layer_input=16,
                         laurel_rank=8, activation_sparsity_pattern=[0.95, 0.0]),
    "gemma4_text": dict(vocab_size_per_layer_input=256, hidden_size_per_layer_input=16),
    "granitemoehybrid": dict(layer_types=ONE_OF_EACH),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "inkling2_text": dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, unpadded_vocab_size=250,
                          sliding_window_size=8, rel_extent=16, n_layers_per_attn_res_block=1),
    "inkling2_loop_text": dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
                               unpadded_vocab_size=250, sliding_window_size=8, rel_extent=16,
                               n_layers_per_attn_res_block=1),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention"]),
    "longcat_flash": dict(num_layers=2, ffn_hidden_size=128, expert_ffn_hidden_size=32, moe_topk=2, zero_expert_num=2,
                          qk_head_dim=32),
    "mamba2": dict(num_heads=8, n_groups=1),
    "reformer": dict(is_decoder=True, hash_seed=0, hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, attn_layers=["local", "lsh"], axial_pos_shape=[3, 4], max_position_embeddings=12, axial_pos_embds_dim=[16, 48],
                     attention_head_size=16, local_attn_chunk_length=4, lsh_attn_chunk_length=4,
                     feed_forward_size=128),
    "roc_bert": dict(pronunciation_vocab_size=32, shape_vocab_size=32, pronunciation_embed_dim=16, shape_embed_dim=16),
    "xlnet": dict(d_head=16),
    "zamba": dict(layer_types=["linear_attention", "hybrid", "hybrid"], num_hidden_layers=3),
    "zamba2": dict(layer_types=ONE_OF_EACH, hybrid_layer_ids=[1]),
    "zaya": dict(num_experts_per_tok=1),
}

# Done to a built model before it runs.
SETUP = {"xmod": lambda model: model.set_default_language("en_XX")}

# The largest tiny model built (parameters counted on the meta device first): a config whose sizes SMALL does not
# reach would otherwise build a full-size model on a 2-core CI box.
MAX_PARAMETERS = 5_000_000

VOCAB = SMALL["vocab_size"]


class Skip(Exception):
    """An entry that is not a decoder-only text model of its own, or that cannot be built small here."""


def _message(e: Exception) -> str:
    return " ".join(str(e).split())[:240]


def entries() -> List[Tuple[str, str]]:
    """(model_type, class name) of every causal LM transformers maps, in its order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())


def build(model_type: str, class_name: str, seed: int = 0):
    """A tiny float32 instance (train mode, eager attention) of one entry; raises Skip with the reason."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    try:
        config_class = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
        model_class = getattr(transformers, class_name)
    except Exception as e:  # an optional dependency missing
        raise Skip(f"not importable here: {type(e).__name__}: {_message(e)}")
    try:
        default = config_class()
    except Exception as e:
        raise Skip(f"its default config does not validate: {type(e).__name__}: {_message(e)}")
    if getattr(default, "is_encoder_decoder", False):
        raise Skip("the decoder of an encoder-decoder model")
    # Sub-configs of a text model's own parts (DBRX's attn_config / ffn_config) are fine; a text_config, vision or
    # audio config makes a composite model whose text decoder is an entry of its own.
    sub = [k for k in getattr(config_class, "sub_configs", {}) or {} if k not in ("attn_config", "ffn_config")]
    if sub:
        raise Skip(f"a composite config ({', '.join(sub)}): multimodal, or a text decoder built from sub-models")
    fields = dict(default.to_dict())
    # Only the fields the config has (a read-only property, such as Falcon's head_dim, is derived: left out).
    values = {k: v for k, v in SMALL.items() if (k in fields or hasattr(default, k))
              and not isinstance(getattr(config_class, k, None), property)}
    if "kv_lora_rank" in values:  # latent attention: keys and values for every query head
        values["num_key_value_heads"] = values["num_attention_heads"]
    values.update(EXTRA.get(model_type, {}))
    if values.get("layer_types") is ONE_OF_EACH:
        # One layer of each kind the default pattern has, in the order they first come (a hybrid keeps an
        # attention layer, which its cache needs). Releases whose config has no pattern get none.
        kinds = list(dict.fromkeys(getattr(default, "layer_types", None) or ()))
        values["layer_types"] = (kinds * 2)[:max(2, len(kinds))] or None
        if kinds:
            values["num_hidden_layers"] = len(values["layer_types"])
    values = {k: v for k, v in values.items() if v is not None}  # None in EXTRA: the config's default
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = config_class(**values)
        except Exception as e:
            raise Skip(f"no tiny config: {type(e).__name__}: {_message(e)}")
    config._attn_implementation = "eager"
    with torch.device("meta"):
        try:
            meta = model_class(config)
        except Exception as e:
            raise Skip(f"no tiny model: {type(e).__name__}: {_message(e)}")
    count = sum(p.numel() for p in meta.parameters())
    if count > MAX_PARAMETERS:
        raise Skip(f"the tiny config still has {count / 1e6:.1f}M parameters (sizes SMALL does not reach)")
    torch.manual_seed(seed)
    model = model_class(config)
    # Random norm weights (initialized to ones, or zeros in the `1 + weight` form) so that a mistake in a
    # weight's role shows; every other parameter keeps its initializer.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name.lower():
                p.add_(torch.randn_like(p) * 0.2)
    if model_type in SETUP:
        SETUP[model_type](model)
    return model.float().train()


def batch(seed: int = 0, b: int = 2, t: int = 12, pad: int = 3):
    g = torch.Generator().manual_seed(seed)
    # Ids below 200: Inkling's head is wider than the vocabulary it predicts (unpadded_vocab_size 250).
    ids = torch.randint(3, 200, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, :pad] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels
