"""Small Hugging Face models of each family the planner is tested on, built from the family's
default config with only the sizes made small (random weights: nothing is downloaded), in train
mode, with their example inputs; ``labels=True`` adds the labels that make the model return its
own loss. Every factory takes ``batch`` and ``length`` so that tests can call a plan with other
shapes."""

from __future__ import annotations

import torch
import transformers

VOCAB = 128


def _ids(batch, length, *, low=3):
    return torch.randint(low, VOCAB, (batch, length))


def _padded_mask(batch, length):
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, length * 3 // 4 :] = 0  # padding: the attention mask matters
    return mask


_DECODER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
)


def _causal_lm(model_class, config_class, **sizes):
    def build(batch=2, length=16, labels=False):
        config = config_class(**{**_DECODER, **sizes})
        config.pad_token_id = config.bos_token_id = config.eos_token_id = 0
        model = model_class(config).train()
        ids = _ids(batch, length)
        kwargs = {"attention_mask": _padded_mask(batch, length)}
        if labels:
            kwargs["labels"] = ids
        return model, (ids,), kwargs

    return build


def gpt2(batch=2, length=16, labels=False):
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        n_positions=128,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config).train()
    ids = _ids(batch, length)
    kwargs = {"attention_mask": _padded_mask(batch, length)}
    if labels:
        kwargs["labels"] = ids
    return model, (ids,), kwargs


def _masked_lm(model_class, config_class, **extra):
    def build(batch=2, length=16, labels=False):
        config = config_class(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=VOCAB,
            max_position_embeddings=130,
            **extra,
        )
        model = model_class(config).train()
        ids = _ids(batch, length)
        kwargs = {"attention_mask": _padded_mask(batch, length)}
        if labels:
            kwargs["labels"] = ids
        return model, (ids,), kwargs

    return build


def _seq2seq(model_class, config):
    def build(batch=2, length=16, labels=False):
        model = model_class(config()).train()
        ids, target = _ids(batch, length), _ids(batch, max(length // 2, 2))
        kwargs = {"attention_mask": _padded_mask(batch, length)}
        kwargs["labels" if labels else "decoder_input_ids"] = target
        return model, (ids,), kwargs

    return build


def _t5_config():
    return transformers.T5Config(
        d_model=32,
        d_ff=64,
        d_kv=16,
        num_layers=2,
        num_heads=2,
        vocab_size=VOCAB,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )


def _bart_config():
    return transformers.BartConfig(
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=2,
    )


def whisper(batch=2, length=16, labels=False):
    config = transformers.WhisperConfig(
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=VOCAB,
        num_mel_bins=16,
        max_source_positions=32,
        max_target_positions=64,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=2,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    model = transformers.WhisperForConditionalGeneration(config).train()
    features = torch.randn(batch, 16, 64)  # Whisper's encoder takes exactly 2 x 32 frames
    target = _ids(batch, length)
    key = "labels" if labels else "decoder_input_ids"
    return model, (features,), {key: target}


def vit(batch=2, length=32, labels=False):
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=5,
    )
    model = transformers.ViTForImageClassification(config).train()
    kwargs = {"interpolate_pos_encoding": True} if length != 32 else {}
    if labels:
        kwargs["labels"] = torch.randint(0, 5, (batch,))
    return model, (torch.randn(batch, 3, length, length),), kwargs


def clip(batch=2, length=16, labels=False):
    config = transformers.CLIPConfig(
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=64,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=16,
    )
    model = transformers.CLIPModel(config).train()
    ids = _ids(batch, length)
    kwargs = {"attention_mask": _padded_mask(batch, length), "return_loss": labels}
    return model, (ids, torch.randn(batch, 3, 32, 32)), kwargs


FAMILIES = {
    "gpt2": gpt2,
    "llama": _causal_lm(transformers.LlamaForCausalLM, transformers.LlamaConfig),
    "mistral": _causal_lm(transformers.MistralForCausalLM, transformers.MistralConfig),
    "qwen2": _causal_lm(transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
    "phi": _causal_lm(transformers.PhiForCausalLM, transformers.PhiConfig),  # gelu_new
    "phi3": _causal_lm(transformers.Phi3ForCausalLM, transformers.Phi3Config),
    "gemma": _causal_lm(transformers.GemmaForCausalLM, transformers.GemmaConfig, head_dim=8),
    "mixtral": _causal_lm(
        transformers.MixtralForCausalLM,
        transformers.MixtralConfig,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "qwen2_moe": _causal_lm(
        transformers.Qwen2MoeForCausalLM,
        transformers.Qwen2MoeConfig,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "bert": _masked_lm(transformers.BertForMaskedLM, transformers.BertConfig),
    "roberta": _masked_lm(
        transformers.RobertaForMaskedLM, transformers.RobertaConfig, pad_token_id=1
    ),
    "t5": _seq2seq(transformers.T5ForConditionalGeneration, _t5_config),
    "bart": _seq2seq(transformers.BartForConditionalGeneration, _bart_config),
    "whisper": whisper,
    "vit": vit,
    "clip": clip,
}
