"""Hand-graded role categories of every trainable parameter of 19 Hugging Face causal LMs.

What this is
------------
More expected answers in the format of ``tests/integrations/hand_graded.py``: read its module docstring
for the categories (``hidden``, ``head``, ``table``, ``elementwise``, ``depthwise``, ``unused``), the
"default forward", and the meaning of ``EXPECTED`` and ``BLOCKS``. The only difference: the keys here
are *config* class names, and each model is built as
``with torch.device("meta"): build_hf_model(name)``, i.e. ``AutoModelForCausalLM.from_config`` on the
tiny config that ``build_hf_model`` picks for that config class. Every trainable parameter name
(``named_parameters(remove_duplicate=False)``, ``requires_grad`` only) is matched by exactly one regex of
``EXPECTED[name]`` under ``re.fullmatch``; a tied head gets its own rule (``head``) beside the
embedding's (``table``).

The categories were written by hand from the ``transformers`` 5.24 sources
(``transformers/models/<model>/modeling_<model>.py``: the forward methods); each group of rules carries
a ``# source:`` comment naming the file, the class / forward and the op that decides. They were NOT
produced by, nor checked against, optzoo's own role inference (nothing here imports ``optzoo.routing``
or anything that routes). One CPU forward + backward of each tiny model (same config, real tensors)
confirmed that every trainable parameter is reached (none is ``unused``).

Expert stacks: every MoE here stores ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` in
an experts class decorated with ``@use_experts_implementation`` (default ``is_transposed=False``; the
eager forward is ``F.linear(x, w[e])``), so each block is ``(E, out, in)`` = the stored shape.

What the tiny builds contain (the config defaults decide which layer kinds exist):

- ``DeepseekV3Config``: ``first_k_dense_replace=3`` > 2 layers, so both layers are dense (no MoE, no
  ``gate``, no ``e_score_correction_bias``, which is a buffer anyway); MLA keeps its default sizes
  (``q_lora_rank=1536``, ``kv_lora_rank=512``, ``qk_nope/rope_head_dim=128/64``, ``v_head_dim=128``),
  since ``build_hf_model``'s first tier (``head_dim=16``) does not run and the second drops
  ``num_key_value_heads`` / ``head_dim``.
- ``Lfm2Config``: ``full_attn_idxs`` defaults to every layer, so both layers are attention layers; no
  ``Lfm2ShortConv`` (its ``conv`` would be ``depthwise``: ``nn.Conv1d(groups=hidden_size)``).
- ``JambaConfig``: ``attn_layer_period=8`` / ``offset=4``: both layers are Mamba layers;
  ``expert_layer_period=2`` / ``offset=1``: layer 0 has a dense MLP, layer 1 a MoE.
- ``Ernie4_5_MoeConfig``: ``moe_layer_start_index=1``: layer 0 dense, layer 1 MoE with shared experts;
  ``gate.moe_statics.e_score_correction_bias`` is an ``nn.Parameter(requires_grad=False)``: not trainable,
  so not graded.
- ``Glm4MoeConfig``: ``first_k_dense_replace=1``: layer 0 dense, layer 1 MoE; the router's
  ``e_score_correction_bias`` is an ``nn.Buffer``.

Every tiny build runs its forward on CPU. On the meta device none of them does as called by hand (the
causal-mask code calls ``.item()``), except Bloom and Mamba; ``build_hf_model`` builds them all.
"""

from __future__ import annotations

EXPECTED: dict[str, list[tuple[str, str]]] = {
    # ======================================================================================
    # Dense decoders
    # ======================================================================================
    "GemmaConfig": [
        # source: models/gemma/modeling_gemma.py, GemmaModel.forward: embed_tokens
        # (GemmaTextScaledWordEmbedding: lookup * embed_scale buffer); tied to lm_head (same tensor)
        (r"model\.embed_tokens\.weight", "table"),
        # source: GemmaAttention.forward: q/k/v_proj -> attention -> o_proj (nn.Linear, no bias)
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        # source: GemmaMLP.forward: down_proj(act(gate_proj(x)) * up_proj(x))
        (r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        # source: GemmaRMSNorm.forward: output * (1.0 + weight): elementwise (zero-centred gain)
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", "elementwise"),
        (r"model\.norm\.weight", "elementwise"),
        # source: GemmaForCausalLM.forward: logits = lm_head(hidden_states) (tied to embed_tokens)
        (r"lm_head\.weight", "head"),
    ],
    "Gemma3TextConfig": [
        # source: models/gemma3/modeling_gemma3.py, Gemma3TextModel.forward: embed_tokens
        # (Gemma3TextScaledWordEmbedding: lookup * embed_scale); tied to lm_head
        (r"model\.embed_tokens\.weight", "table"),
        # source: Gemma3Attention.forward: q/k/v_proj -> q_norm / k_norm (per-head Gemma3RMSNorm, [head_dim])
        # -> rope -> attention -> o_proj
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.self_attn\.(q_norm|k_norm)\.weight", "elementwise"),
        # source: Gemma3MLP.forward: down_proj(act(gate_proj(x)) * up_proj(x))
        (r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        # source: Gemma3DecoderLayer.forward: input / post_attention / pre_feedforward / post_feedforward
        # Gemma3RMSNorm (x * (1.0 + weight))
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm)\.weight", "elementwise"),
        (r"model\.norm\.weight", "elementwise"),
        # source: Gemma3ForCausalLM.forward: logits = lm_head(hidden_states) (softcapping None; tied)
        (r"lm_head\.weight", "head"),
    ],
    "Phi3Config": [
        # source: models/phi3/modeling_phi3.py, Phi3Model.forward: embed_tokens (not tied)
        (r"model\.embed_tokens\.weight", "table"),
        # source: Phi3Attention.forward: qkv = qkv_proj(x), then the *product* is sliced into q, k, v (one
        # matrix, output split after the matmul); o_proj
        (r"model\.layers\.\d+\.self_attn\.(qkv_proj|o_proj)\.weight", "hidden"),
        # source: Phi3MLP.forward: gate_up_proj(x).chunk(2) -> up * act(gate) -> down_proj
        (r"model\.layers\.\d+\.mlp\.(gate_up_proj|down_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", "elementwise"),
        (r"model\.norm\.weight", "elementwise"),
        # source: Phi3ForCausalLM.forward: lm_head -> logits
        (r"lm_head\.weight", "head"),
    ],
    "PhiConfig": [
        # source: models/phi/modeling_phi.py, PhiModel.forward: embed_tokens -> embed_dropout
        (r"model\.embed_tokens\.weight", "table"),
        # source: PhiAttention.forward: q/k/v_proj (bias) -> attention (qk_layernorm=False) -> dense (bias)
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|dense)\.weight", "hidden"),
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|dense)\.bias", "elementwise"),
        # source: PhiMLP.forward: fc2(act(fc1(x))) (with biases)
        (r"model\.layers\.\d+\.mlp\.(fc1|fc2)\.weight", "hidden"),
        (r"model\.layers\.\d+\.mlp\.(fc1|fc2)\.bias", "elementwise"),
        # source: PhiDecoderLayer.forward: one nn.LayerNorm feeds attention and MLP in parallel
        (r"model\.layers\.\d+\.input_layernorm\.(weight|bias)", "elementwise"),
        (r"model\.final_layernorm\.(weight|bias)", "elementwise"),
        # source: PhiForCausalLM.forward: lm_head = nn.Linear(bias=True) -> logits; its bias is added to them
        (r"lm_head\.weight", "head"),
        (r"lm_head\.bias", "elementwise"),
    ],
    "Qwen2Config": [
        # source: models/qwen2/modeling_qwen2.py, Qwen2Model.forward: embed_tokens (not tied)
        (r"model\.embed_tokens\.weight", "table"),
        # source: Qwen2Attention.__init__/forward: q/k/v_proj nn.Linear(bias=True), o_proj (no bias)
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj)\.bias", "elementwise"),
        # source: Qwen2MLP.forward: down_proj(act(gate_proj(x)) * up_proj(x))
        (r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", "elementwise"),
        (r"model\.norm\.weight", "elementwise"),
        # source: Qwen2ForCausalLM.forward: lm_head -> logits
        (r"lm_head\.weight", "head"),
    ],
    "Qwen3Config": [
        # source: models/qwen3/modeling_qwen3.py, Qwen3Model.forward: embed_tokens (not tied)
        (r"model\.embed_tokens\.weight", "table"),
        # source: Qwen3Attention.forward: q_norm(q_proj(x).view(heads)), k_norm(k_proj(x).view(heads))
        # (per-head RMSNorm [head_dim]) -> attention -> o_proj
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.self_attn\.(q_norm|k_norm)\.weight", "elementwise"),
        # source: Qwen3MLP.forward: down_proj(act(gate_proj(x)) * up_proj(x))
        (r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", "elementwise"),
        (r"model\.norm\.weight", "elementwise"),
        # source: Qwen3ForCausalLM.forward: lm_head -> logits
        (r"lm_head\.weight", "head"),
    ],
    "Olmo2Config": [
        # source: models/olmo2/modeling_olmo2.py, Olmo2Model.forward: embed_tokens (not tied)
        (r"model\.embed_tokens\.weight", "table"),
        # source: Olmo2Attention.forward: q_norm(q_proj(x)), k_norm(k_proj(x)) (RMSNorm over the whole
        # projection: [heads * head_dim], [kv_heads * head_dim]) -> attention -> o_proj
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.self_attn\.(q_norm|k_norm)\.weight", "elementwise"),
        # source: Olmo2MLP.forward: down_proj(act(gate_proj(x)) * up_proj(x))
        (r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        # source: Olmo2DecoderLayer.forward: post-norms on the attention and MLP outputs before the residual
        # add (no input norm)
        (r"model\.layers\.\d+\.(post_attention_layernorm|post_feedforward_layernorm)\.weight", "elementwise"),
        (r"model\.norm\.weight", "elementwise"),
        # source: Olmo2ForCausalLM.forward: lm_head -> logits
        (r"lm_head\.weight", "head"),
    ],
    "MistralConfig": [
        # source: models/mistral/modeling_mistral.py, MistralModel.forward: embed_tokens (not tied)
        (r"model\.embed_tokens\.weight", "table"),
        # source: MistralAttention.forward: q/k/v_proj -> attention -> o_proj (no biases)
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        # source: MistralMLP.forward: down_proj(act(gate_proj(x)) * up_proj(x))
        (r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", "elementwise"),
        (r"model\.norm\.weight", "elementwise"),
        # source: MistralForCausalLM.forward: lm_head -> logits
        (r"lm_head\.weight", "head"),
    ],
    "StableLmConfig": [
        # source: models/stablelm/modeling_stablelm.py, StableLmModel.forward: embed_tokens (not tied)
        (r"model\.embed_tokens\.weight", "table"),
        # source: StableLmAttention.forward: q/k/v_proj (use_qkv_bias=False, qk_layernorm=False) -> partial
        # rope -> attention -> o_proj
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        # source: StableLmMLP.forward: down_proj(act(gate_proj(x)) * up_proj(x))
        (r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        # source: StableLmDecoderLayer: nn.LayerNorm (weight and bias); post_attention_layernorm exists since
        # use_parallel_residual=False; StableLmModel.norm
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.(weight|bias)", "elementwise"),
        (r"model\.norm\.(weight|bias)", "elementwise"),
        # source: StableLmForCausalLM.forward: lm_head -> logits
        (r"lm_head\.weight", "head"),
    ],
    "GPTNeoXConfig": [
        # source: models/gpt_neox/modeling_gpt_neox.py, GPTNeoXModel.forward: embed_in (nn.Embedding; not tied)
        (r"gpt_neox\.embed_in\.weight", "table"),
        # source: GPTNeoXAttention.forward: query_key_value(x).view(..., 3 * head_size).chunk(3) (one matrix,
        # the product is split) -> attention -> dense (attention_bias=True)
        (r"gpt_neox\.layers\.\d+\.attention\.(query_key_value|dense)\.weight", "hidden"),
        (r"gpt_neox\.layers\.\d+\.attention\.(query_key_value|dense)\.bias", "elementwise"),
        # source: GPTNeoXMLP.forward: dense_4h_to_h(act(dense_h_to_4h(x))) (with biases)
        (r"gpt_neox\.layers\.\d+\.mlp\.(dense_h_to_4h|dense_4h_to_h)\.weight", "hidden"),
        (r"gpt_neox\.layers\.\d+\.mlp\.(dense_h_to_4h|dense_4h_to_h)\.bias", "elementwise"),
        # source: GPTNeoXLayer.forward: input_layernorm -> attention, post_attention_layernorm -> mlp
        # (parallel residual); GPTNeoXModel.final_layer_norm
        (r"gpt_neox\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.(weight|bias)", "elementwise"),
        (r"gpt_neox\.final_layer_norm\.(weight|bias)", "elementwise"),
        # source: GPTNeoXForCausalLM.forward: lm_head (nn.Linear, no bias) -> logits
        (r"lm_head\.weight", "head"),
    ],
    "BloomConfig": [
        # source: models/bloom/modeling_bloom.py, BloomModel.forward: word_embeddings (nn.Embedding; tied to
        # lm_head) -> word_embeddings_layernorm; ALiBi slopes are computed (no parameter)
        (r"transformer\.word_embeddings\.weight", "table"),
        (r"transformer\.word_embeddings_layernorm\.(weight|bias)", "elementwise"),
        # source: BloomAttention.forward: fused_qkv = query_key_value(x), split into heads after the matmul
        # (one matrix) -> alibi.baddbmm scores -> dense (pretraining_tp=1: one F.linear)
        (r"transformer\.h\.\d+\.self_attention\.(query_key_value|dense)\.weight", "hidden"),
        (r"transformer\.h\.\d+\.self_attention\.(query_key_value|dense)\.bias", "elementwise"),
        # source: BloomMLP.forward: dense_4h_to_h(gelu(dense_h_to_4h(x)))
        (r"transformer\.h\.\d+\.mlp\.(dense_h_to_4h|dense_4h_to_h)\.weight", "hidden"),
        (r"transformer\.h\.\d+\.mlp\.(dense_h_to_4h|dense_4h_to_h)\.bias", "elementwise"),
        (r"transformer\.h\.\d+\.(input_layernorm|post_attention_layernorm)\.(weight|bias)", "elementwise"),
        (r"transformer\.ln_f\.(weight|bias)", "elementwise"),
        # source: BloomForCausalLM.forward: lm_head = nn.Linear(bias=False) -> logits (tied)
        (r"lm_head\.weight", "head"),
    ],
    # ======================================================================================
    # Mixture of experts
    # ======================================================================================
    "OlmoeConfig": [
        # source: models/olmoe/modeling_olmoe.py, OlmoeModel.forward: embed_tokens (not tied)
        (r"model\.embed_tokens\.weight", "table"),
        # source: OlmoeAttention.forward: q_norm(q_proj(x)), k_norm(k_proj(x)) (RMSNorm over the whole
        # projection) -> attention -> o_proj
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.self_attn\.(q_norm|k_norm)\.weight", "elementwise"),
        # source: OlmoeTopKRouter.forward: F.linear(x, weight) -> softmax -> top-k weights scale the expert
        # outputs; OlmoeExperts.forward: F.linear(x, gate_up_proj[e]).chunk(2) -> act * up ->
        # F.linear(h, down_proj[e])
        (r"model\.layers\.\d+\.mlp\.gate\.weight", "hidden"),
        (r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)", "hidden"),
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", "elementwise"),
        (r"model\.norm\.weight", "elementwise"),
        # source: OlmoeForCausalLM.forward: lm_head -> logits
        (r"lm_head\.weight", "head"),
    ],
    "GraniteMoeConfig": [
        # source: models/granitemoe/modeling_granitemoe.py, GraniteMoeModel.forward: embed_tokens *
        # embedding_multiplier (not tied)
        (r"model\.embed_tokens\.weight", "table"),
        # source: GraniteMoeAttention.forward: q/k/v_proj -> attention (scaling attention_multiplier) -> o_proj
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        # source: GraniteMoeTopKRouter.forward: F.linear(x, weight) -> topk -> softmax weights scale the expert
        # outputs; GraniteMoeExperts.forward: F.linear(x, gate_up_proj[e]).chunk(2) ->
        # F.linear(h, down_proj[e])
        (r"model\.layers\.\d+\.block_sparse_moe\.router\.weight", "hidden"),
        (r"model\.layers\.\d+\.block_sparse_moe\.experts\.(gate_up_proj|down_proj)", "hidden"),
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", "elementwise"),
        (r"model\.norm\.weight", "elementwise"),
        # source: GraniteMoeForCausalLM.forward: lm_head(hidden) / logits_scaling -> logits
        (r"lm_head\.weight", "head"),
    ],
    "Ernie4_5_MoeConfig": [
        # source: models/ernie4_5_moe/modeling_ernie4_5_moe.py, Ernie4_5_MoeModel.forward: embed_tokens (tied
        # to lm_head, tie_word_embeddings=True)
        (r"model\.embed_tokens\.weight", "table"),
        # source: Ernie4_5_MoeAttention.forward: q/k/v_proj -> attention -> o_proj (use_bias=False)
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        # source: Ernie4_5_MoeDecoderLayer.__init__: layer 0 (< moe_layer_start_index) is a dense
        # Ernie4_5_MoeMLP; Ernie4_5_MoeSparseMoeBlock's shared_experts is the same MLP class:
        # down_proj(act(gate_proj(x)) * up_proj(x))
        (r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        # source: Ernie4_5_MoeTopKRouter.forward: F.linear(x.float(), weight.float()) -> softmax -> gathered
        # top-k weights scale the expert outputs (moe_statics.e_score_correction_bias only shifts the top-k
        # choice and has requires_grad=False: not graded); Ernie4_5_MoeExperts.forward: F.linear(x,
        # gate_up_proj[e]).chunk(2) -> F.linear(h, down_proj[e])
        (r"model\.layers\.\d+\.mlp\.gate\.weight", "hidden"),
        (r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)", "hidden"),
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", "elementwise"),
        (r"model\.norm\.weight", "elementwise"),
        # source: Ernie4_5_MoeForCausalLM.forward: lm_head -> logits (tied)
        (r"lm_head\.weight", "head"),
    ],
    "Glm4MoeConfig": [
        # source: models/glm4_moe/modeling_glm4_moe.py, Glm4MoeModel.forward: embed_tokens (not tied)
        (r"model\.embed_tokens\.weight", "table"),
        # source: Glm4MoeAttention.forward: q/k/v_proj (use_qk_norm=False, attention_bias=False) -> attention
        # -> o_proj
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        # source: Glm4MoeDecoderLayer.__init__: layer 0 (< first_k_dense_replace) is a dense Glm4MoeMLP;
        # Glm4MoeMoE.shared_experts is the same class: down_proj(act(gate_proj(x)) * up_proj(x))
        (r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        # source: Glm4MoeTopkRouter.forward: F.linear(x.float(), weight.float()) -> sigmoid -> gathered top-k
        # weights scale the expert outputs (e_score_correction_bias is an nn.Buffer); Glm4MoeExperts.forward:
        # F.linear(x, gate_up_proj[e]).chunk(2) -> F.linear(h, down_proj[e])
        (r"model\.layers\.\d+\.mlp\.gate\.weight", "hidden"),
        (r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)", "hidden"),
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", "elementwise"),
        (r"model\.norm\.weight", "elementwise"),
        # source: Glm4MoeForCausalLM.forward: lm_head -> logits
        (r"lm_head\.weight", "head"),
    ],
    "DeepseekV3Config": [
        # source: models/deepseek_v3/modeling_deepseek_v3.py, DeepseekV3Model.forward: embed_tokens (not tied)
        (r"model\.embed_tokens\.weight", "table"),
        # source: DeepseekV3Attention.forward (MLA): q_b_proj(q_a_layernorm(q_a_proj(x))) -> split nope / rope;
        # kv_a_proj_with_mqa(x) -> split (compressed kv, k_rot) -> kv_a_layernorm -> expand_kv: kv_b_proj ->
        # split k_nope / v (products split, each one matrix); attention -> o_proj
        (r"model\.layers\.\d+\.self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.self_attn\.(q_a_layernorm|kv_a_layernorm)\.weight", "elementwise"),
        # source: DeepseekV3DecoderLayer.__init__: layer_idx < first_k_dense_replace (3) -> DeepseekV3MLP:
        # down_proj(act(gate_proj(x)) * up_proj(x)). Both tiny layers are dense: no DeepseekV3MoE here (its
        # gate would be hidden, experts hidden with BLOCKS (4, 64, 64) / (4, 64, 32), shared_experts hidden,
        # and gate.e_score_correction_bias is an nn.Buffer, not a parameter)
        (r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", "elementwise"),
        (r"model\.norm\.weight", "elementwise"),
        # source: DeepseekV3ForCausalLM.forward: lm_head -> logits
        (r"lm_head\.weight", "head"),
    ],
    # ======================================================================================
    # SSM / hybrid / convolutional
    # ======================================================================================
    "JambaConfig": [
        # source: models/jamba/modeling_jamba.py, JambaModel.forward: embed_tokens (not tied)
        (r"model\.embed_tokens\.weight", "table"),
        # source: JambaMambaDecoderLayer.forward: input_layernorm -> mamba; pre_ff_layernorm -> feed_forward;
        # JambaModel.final_layernorm
        (r"model\.layers\.\d+\.(input_layernorm|pre_ff_layernorm)\.weight", "elementwise"),
        (r"model\.final_layernorm\.weight", "elementwise"),
        # source: JambaMambaMixer.forward: in_proj(x).chunk(2) -> causal_conv1d_fn (F.conv1d with
        # groups=hidden_size, conv1d built with groups=intermediate_size: depthwise) -> x_proj -> split
        # (dt, B, C) -> dt/b/c_layernorm (JambaRMSNorm) -> dt_proj.weight @ dt -> mamba_selective_scan with
        # A = -exp(A_log), D skip, delta_bias = dt_proj.bias (softplus(dt + bias)) -> out_proj
        (r"model\.layers\.\d+\.mamba\.(in_proj|x_proj|dt_proj|out_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.mamba\.conv1d\.weight", "depthwise"),
        (r"model\.layers\.\d+\.mamba\.(conv1d|dt_proj)\.bias", "elementwise"),
        (r"model\.layers\.\d+\.mamba\.(A_log|D)", "elementwise"),
        (r"model\.layers\.\d+\.mamba\.(dt_layernorm|b_layernorm|c_layernorm)\.weight", "elementwise"),
        # source: JambaMLP.forward (layer 0): down_proj(act(gate_proj(x)) * up_proj(x))
        (r"model\.layers\.\d+\.feed_forward\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        # source: JambaSparseMoeBlock.forward (layer 1): JambaTopKRouter (F.linear -> softmax -> top-k weights
        # scale the expert outputs); JambaExperts.forward: F.linear(x, gate_up_proj[e]).chunk(2) ->
        # F.linear(h, down_proj[e])
        (r"model\.layers\.\d+\.feed_forward\.router\.weight", "hidden"),
        (r"model\.layers\.\d+\.feed_forward\.experts\.(gate_up_proj|down_proj)", "hidden"),
        # source: JambaForCausalLM.forward: lm_head -> logits
        (r"lm_head\.weight", "head"),
    ],
    "MambaConfig": [
        # source: models/mamba/modeling_mamba.py, MambaModel.forward: embeddings(input_ids) (nn.Embedding; tied
        # to lm_head)
        (r"backbone\.embeddings\.weight", "table"),
        # source: MambaBlock.forward: norm (MambaRMSNorm) -> mixer; MambaModel.forward: norm_f
        (r"backbone\.layers\.\d+\.norm\.weight", "elementwise"),
        (r"backbone\.norm_f\.weight", "elementwise"),
        # source: MambaMixer.forward (training, no cache: mamba_inner_fn's fallback returns None, so the torch
        # path runs): in_proj(x).chunk(2) -> causal_conv1d_fn (F.conv1d groups=hidden_size: depthwise) ->
        # x_proj -> split (dt, B, C) -> dt_proj.weight @ dt -> mamba_selective_scan with A = -exp(A_log),
        # D skip, delta_bias = dt_proj.bias -> out_proj
        (r"backbone\.layers\.\d+\.mixer\.(in_proj|x_proj|dt_proj|out_proj)\.weight", "hidden"),
        (r"backbone\.layers\.\d+\.mixer\.conv1d\.weight", "depthwise"),
        (r"backbone\.layers\.\d+\.mixer\.(conv1d|dt_proj)\.bias", "elementwise"),
        (r"backbone\.layers\.\d+\.mixer\.(A_log|D)", "elementwise"),
        # source: MambaForCausalLM.forward: lm_head -> logits (tied)
        (r"lm_head\.weight", "head"),
    ],
    "Lfm2Config": [
        # source: models/lfm2/modeling_lfm2.py, Lfm2Model.forward: embed_tokens (tied to lm_head)
        (r"model\.embed_tokens\.weight", "table"),
        # source: Lfm2Attention.forward: q_layernorm(q_proj(x).view(heads)), k_layernorm(k_proj(x).view(heads))
        # (per-head RMSNorm [head_dim]) -> attention -> out_proj. Both tiny layers are attention layers
        # (full_attn_idxs defaults to every layer): no Lfm2ShortConv, whose conv (groups=hidden_size) would be
        # depthwise and in_proj / out_proj hidden
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|out_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.self_attn\.(q_layernorm|k_layernorm)\.weight", "elementwise"),
        # source: Lfm2MLP.forward: w2(silu(w1(x)) * w3(x))
        (r"model\.layers\.\d+\.feed_forward\.(w1|w2|w3)\.weight", "hidden"),
        # source: Lfm2DecoderLayer.forward: operator_norm -> attention, ffn_norm -> feed_forward;
        # Lfm2Model.forward: embedding_norm is applied after the last layer (the final norm)
        (r"model\.layers\.\d+\.(operator_norm|ffn_norm)\.weight", "elementwise"),
        (r"model\.embedding_norm\.weight", "elementwise"),
        # source: Lfm2ForCausalLM.forward: lm_head -> logits (tied)
        (r"lm_head\.weight", "head"),
    ],
}

BLOCKS: dict[str, list[tuple[str, tuple[int, int, int]]]] = {
    # config class -> [(regex of a param, (number of blocks, out, in) of the matrices the forward multiplies
    # by, per block)]. Only expert stacks: every other fused weight here (Phi3 qkv_proj / gate_up_proj,
    # GPT-NeoX and Bloom query_key_value, Mamba / Jamba in_proj and x_proj, MLA kv_a_proj_with_mqa /
    # kv_b_proj) has its *product* split after one matmul: one matrix.

    # source: OlmoeExperts.forward: F.linear(x, gate_up_proj[e]) with gate_up_proj [E, 2I, H] = [4, 256, 64]
    # (intermediate_size 128); F.linear(h, down_proj[e]) with down_proj [E, H, I] = [4, 64, 128]
    "OlmoeConfig": [
        (r"model\.layers\.\d+\.mlp\.experts\.gate_up_proj", (4, 256, 64)),
        (r"model\.layers\.\d+\.mlp\.experts\.down_proj", (4, 64, 128)),
    ],
    # source: GraniteMoeExperts.forward: F.linear with gate_up_proj [4, 256, 64] and down_proj [4, 64, 128]
    "GraniteMoeConfig": [
        (r"model\.layers\.\d+\.block_sparse_moe\.experts\.gate_up_proj", (4, 256, 64)),
        (r"model\.layers\.\d+\.block_sparse_moe\.experts\.down_proj", (4, 64, 128)),
    ],
    # source: Ernie4_5_MoeExperts.forward: F.linear with gate_up_proj [4, 64, 64] (moe_intermediate_size 32)
    # and down_proj [4, 64, 32]
    "Ernie4_5_MoeConfig": [
        (r"model\.layers\.\d+\.mlp\.experts\.gate_up_proj", (4, 64, 64)),
        (r"model\.layers\.\d+\.mlp\.experts\.down_proj", (4, 64, 32)),
    ],
    # source: Glm4MoeExperts.forward: F.linear with gate_up_proj [4, 64, 64] and down_proj [4, 64, 32]
    "Glm4MoeConfig": [
        (r"model\.layers\.\d+\.mlp\.experts\.gate_up_proj", (4, 64, 64)),
        (r"model\.layers\.\d+\.mlp\.experts\.down_proj", (4, 64, 32)),
    ],
    # source: JambaExperts.forward: F.linear with gate_up_proj [4, 256, 64] (intermediate_size 128) and
    # down_proj [4, 64, 128]
    "JambaConfig": [
        (r"model\.layers\.\d+\.feed_forward\.experts\.gate_up_proj", (4, 256, 64)),
        (r"model\.layers\.\d+\.feed_forward\.experts\.down_proj", (4, 64, 128)),
    ],
}
