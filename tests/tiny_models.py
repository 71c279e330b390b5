"""Tiny random-weight HF models of each supported architecture (no hub access), saved to disk."""
import torch

VOCAB = 500  # not a multiple of 128: exercises megatron's vocabulary padding


def hf_config(arch: str, **over):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "qwen3":  # q/k norm, explicit head_dim (>= 32, vLLM CPU's minimum)
        cfg = Qwen3Config(**{**common, "head_dim": 32, "tie_word_embeddings": False,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, **over})
        cfg.architectures = ["Qwen3ForCausalLM"]
    elif arch == "qwen2":  # QKV bias, tied embeddings
        cfg = Qwen2Config(**{**common, "tie_word_embeddings": True,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **over})
        cfg.architectures = ["Qwen2ForCausalLM"]
    elif arch == "llama":  # Llama-3 RoPE scaling
        cfg = LlamaConfig(**{**common, "tie_word_embeddings": False,
                             "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 64}, **over})
        cfg.architectures = ["LlamaForCausalLM"]
    elif arch == "qwen3_moe":  # 4 experts, top-2; layer 0 dense (mlp_only_layers), the others MoE
        cfg = Qwen3MoeConfig(**{**common, "head_dim": 32, "tie_word_embeddings": False, "num_experts": 4,
                                "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True,
                                "mlp_only_layers": [0], "decoder_sparse_step": 1, "router_aux_loss_coef": 0.0,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, **over})
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    else:
        raise ValueError(arch)
    return cfg


def save_tiny_model(arch: str, path, seed: int = 0, **over):
    """Build a random tiny model (float32), save it as safetensors; return the HF model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(arch, **over)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms default to ones; randomise them so the maps are really tested
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path), safe_serialization=True)
    return model.eval()
