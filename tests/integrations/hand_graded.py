"""Hand-graded role categories of every trainable parameter of 40 Hugging Face models.

What this is
------------
Expected answers, written by hand, for grading optzoo's automatic role inference. For each model class
(built as the tests build it: ``with torch.device("meta"): build_hf_model(name)``, tiny config, random
init) ``EXPECTED[name]`` lists ``(regex, category)`` rules; every trainable parameter name of the model
(``named_parameters(remove_duplicate=False)``, so a tied tensor appears under each of its names) is
matched by exactly one regex under ``re.fullmatch``.

The categories were decided by reading the forward methods of the ``transformers`` 5.24 sources
(``transformers/models/<model>/modeling_<model>.py``); each group of rules carries a ``# source:``
comment naming the file, the class / forward and the op that decides. They were NOT produced by, nor
checked against, optzoo's own role inference (nothing here imports ``optzoo.routing`` or anything that
routes). A hand-written autograd-graph trace of one default forward (own hooks only) was used to confirm
the reading: which parameters are reached at all, and whether a matmul's product feeds a later
parametric matmul.

"Default forward": the model as built (``nn.Module`` default: training mode), called with only its
required inputs (``input_ids``; ``pixel_values``; ``input_values`` / ``input_features``;
``decoder_input_ids`` for encoder-decoders), ``use_cache=False``, no labels, no
``output_hidden_states`` / ``output_attentions``, no optional masks (``bool_masked_pos``,
``token_type_ids`` where the model has no default for them, ``target_mapping``).

Categories (defined by what the forward does with the parameter)
----------------------------------------------------------------
- ``hidden``: the weight of a matmul / linear / conv (not depthwise) contracted against activations,
  whose product feeds at least one further parametric matmul later. Attention q/k/v/o, MLP weights,
  MoE routers/gates, expert weight stacks (3-D ``[E, out, in]`` or ``[E, in, out]``), shared experts,
  poolers that feed a classifier, projections between towers, input layers (a patch-embedding conv on
  pixel_values, an audio feature-extractor conv on raw audio, the first Linear on float features),
  grouped (non-depthwise) convs, positional convs.
- ``head``: the weight of a matmul whose product is a model output (logits, class scores, start/end
  span logits, next-sentence logits, discriminator logits, distillation logits, contrastive image/text
  embeddings or their logits) with NO other parametric matmul after it (elementwise ops such as adding a
  bias, scaling, tanh, softcapping, averaging two heads are allowed after it). Outputs considered are
  what the model returns with default arguments and ``use_cache=False``. A residual stream returned as
  ``last_hidden_state`` does not make its writers heads. A head tied to the input embedding (same
  tensor) is both ``table`` and ``head``: each name gets its own category (the embedding name
  ``table``, the head name ``head``).
- ``table``: read by index (``nn.Embedding``, ``F.embedding``, gather / index_select, relative-position
  bias tables indexed by a relative-position index), OR a bare ``nn.Parameter`` whose *values enter the
  activations*: added along a token/position axis (learned position tables such as ``[1, N, d]``),
  concatenated into the sequence (cls / distillation / register tokens), substituted at masked
  positions (mask tokens), or used as the input (not the weight) of a matmul (Perceiver latents,
  attention-pooling probes / queries).
- ``elementwise``: used only elementwise with activations: norm weights and biases, linear / conv
  biases, gains and layer scales of any shape (``[C]``, ``[1,1,C]``, ``[1,1,1,C]``), 0-D or 1-element
  logit scales / biases, SSM parameters (``A_log``, ``D``, ``dt_bias``), RWKV time-mix / time-decay /
  time-first, weight-norm ``g`` (the magnitude that scales a weight), per-head bias vectors added to q
  (XLNet's ``r_w_bias``), mask tokens blended in by multiplication.
- ``depthwise``: the weight of a depthwise conv (``groups == in_channels``, one input channel per
  output group: Mamba's ``conv1d``, ConvNeXt's ``dwconv``, MobileNet depthwise convs).
- ``unused``: never reached by the default forward (no gradient); the comment says what it would be
  when the optional input that uses it is passed.

``BLOCKS[name]`` lists, for every parameter whose forward splits it into several matrices before the
matmul (expert stacks, per-head / per-group stacks, grouped convs, packed q/k/v split before the
matmul), ``(regex, (number of blocks, out, in))``: the matrices the forward multiplies by, per block,
``out`` the output dim and ``in`` the contracted dim (for a grouped conv ``in = in_channels / groups *
kernel elements``). Shapes are those of the tiny models ``build_hf_model`` builds. A fused weight whose
*output* is split after one matmul (``gate_up_proj`` chunked, ``in_proj`` of Mamba, ``kv_b_proj``) is one
matrix per block, not several.

Substitutions: none; every requested class builds with ``build_hf_model`` (some keep default, non-tiny
sizes where ``TINY_SHAPE`` does not reach their fields: Mamba2, XLNet, Whisper, Perceiver, Swin,
ConvNeXt, MobileNetV2, DistilBERT's FFN, Switch's decoder depth).

Four tiny builds do not run a forward as built, so their categories rest on the source alone (the
confirming trace ran on a minimally patched copy with the same parameter names):
ConvNextForImageClassification / ConvNextV2ForImageClassification (2 stages but 4 ``hidden_sizes``:
the final layernorm expects 768 channels, gets 192), DeepseekV2ForCausalLM (``num_experts_per_tok``
stays ``None``, so ``topk(k=None)``; ``num_key_value_heads=2`` makes ``repeat_kv`` double MLA's heads),
CLIPModel (the text ``eos_token_id`` is unset, so the eos pooling compares ``input_ids == None``).
"""

from __future__ import annotations

EXPECTED: dict[str, list[tuple[str, str]]] = {
    # ======================================================================================
    # Encoders and task heads
    # ======================================================================================
    "BertForPreTraining": [
        # source: models/bert/modeling_bert.py, BertEmbeddings.forward: word/position/token_type nn.Embedding
        # lookups, summed (token_type_ids default to the zero buffer, so token_type_embeddings is read)
        (r"bert\.embeddings\.(word|position|token_type)_embeddings\.weight", "table"),
        (r"bert\.embeddings\.LayerNorm\.(weight|bias)", "elementwise"),
        # source: BertSelfAttention.forward (query/key/value nn.Linear), BertSelfOutput / BertIntermediate /
        # BertOutput .forward (dense nn.Linear): products feed the next layer's matmuls or the heads
        (r"bert\.encoder\.layer\.\d+\.attention\.self\.(query|key|value)\.weight", "hidden"),
        (r"bert\.encoder\.layer\.\d+\.(attention\.output|intermediate|output)\.dense\.weight", "hidden"),
        (r"bert\.encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense|output\.dense)\.bias", "elementwise"),
        (r"bert\.encoder\.layer\.\d+\.(attention\.output|output)\.LayerNorm\.(weight|bias)", "elementwise"),
        # source: BertPooler.forward: dense + tanh on token 0; BertPreTrainingHeads.forward feeds the pooled
        # output to seq_relationship (a further matmul), so the pooler is hidden
        (r"bert\.pooler\.dense\.weight", "hidden"),
        (r"bert\.pooler\.dense\.bias", "elementwise"),
        # source: BertPredictionHeadTransform.forward: dense -> act -> LayerNorm, then BertLMPredictionHead's
        # decoder (a further matmul): transform.dense is hidden
        (r"cls\.predictions\.transform\.dense\.weight", "hidden"),
        (r"cls\.predictions\.transform\.dense\.bias", "elementwise"),
        (r"cls\.predictions\.transform\.LayerNorm\.(weight|bias)", "elementwise"),
        # source: BertLMPredictionHead.forward: decoder nn.Linear -> prediction_logits (tied to
        # word_embeddings: that name is `table`, this one `head`); `cls.predictions.bias` is the same tensor
        # as decoder.bias, added to the logits
        (r"cls\.predictions\.decoder\.weight", "head"),
        (r"cls\.predictions\.(decoder\.)?bias", "elementwise"),
        # source: BertPreTrainingHeads.forward: seq_relationship(pooled_output) -> seq_relationship_logits
        (r"cls\.seq_relationship\.weight", "head"),
        (r"cls\.seq_relationship\.bias", "elementwise"),
    ],
    "BertForQuestionAnswering": [
        # source: models/bert/modeling_bert.py, BertEmbeddings.forward: three nn.Embedding lookups, summed
        (r"bert\.embeddings\.(word|position|token_type)_embeddings\.weight", "table"),
        (r"bert\.embeddings\.LayerNorm\.(weight|bias)", "elementwise"),
        # source: BertSelfAttention / BertSelfOutput / BertIntermediate / BertOutput .forward: nn.Linear
        (r"bert\.encoder\.layer\.\d+\.attention\.self\.(query|key|value)\.weight", "hidden"),
        (r"bert\.encoder\.layer\.\d+\.(attention\.output|intermediate|output)\.dense\.weight", "hidden"),
        (r"bert\.encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense|output\.dense)\.bias", "elementwise"),
        (r"bert\.encoder\.layer\.\d+\.(attention\.output|output)\.LayerNorm\.(weight|bias)", "elementwise"),
        # source: BertForQuestionAnswering.forward: qa_outputs(sequence_output).split -> start/end logits
        # (no pooler: BertModel(add_pooling_layer=False))
        (r"qa_outputs\.weight", "head"),
        (r"qa_outputs\.bias", "elementwise"),
    ],
    "RobertaForSequenceClassification": [
        # source: models/roberta/modeling_roberta.py, RobertaEmbeddings.forward: nn.Embedding lookups, summed
        (r"roberta\.embeddings\.(word|position|token_type)_embeddings\.weight", "table"),
        (r"roberta\.embeddings\.LayerNorm\.(weight|bias)", "elementwise"),
        # source: RobertaSelfAttention / RobertaSelfOutput / RobertaIntermediate / RobertaOutput .forward
        (r"roberta\.encoder\.layer\.\d+\.attention\.self\.(query|key|value)\.weight", "hidden"),
        (r"roberta\.encoder\.layer\.\d+\.(attention\.output|intermediate|output)\.dense\.weight", "hidden"),
        (r"roberta\.encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense|output\.dense)\.bias", "elementwise"),
        (r"roberta\.encoder\.layer\.\d+\.(attention\.output|output)\.LayerNorm\.(weight|bias)", "elementwise"),
        # source: RobertaClassificationHead.forward: dense(<s>) -> tanh -> out_proj -> logits
        (r"classifier\.dense\.weight", "hidden"),
        (r"classifier\.out_proj\.weight", "head"),
        (r"classifier\.(dense|out_proj)\.bias", "elementwise"),
    ],
    "ElectraForPreTraining": [
        # source: models/electra/modeling_electra.py, ElectraEmbeddings.forward: nn.Embedding lookups, summed
        (r"electra\.embeddings\.(word|position|token_type)_embeddings\.weight", "table"),
        (r"electra\.embeddings\.LayerNorm\.(weight|bias)", "elementwise"),
        # source: ElectraModel.forward: embeddings_project nn.Linear (embedding_size 128 -> hidden 64)
        (r"electra\.embeddings_project\.weight", "hidden"),
        (r"electra\.embeddings_project\.bias", "elementwise"),
        # source: ElectraSelfAttention / ElectraSelfOutput / ElectraIntermediate / ElectraOutput .forward
        (r"electra\.encoder\.layer\.\d+\.attention\.self\.(query|key|value)\.weight", "hidden"),
        (r"electra\.encoder\.layer\.\d+\.(attention\.output|intermediate|output)\.dense\.weight", "hidden"),
        (r"electra\.encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense|output\.dense)\.bias", "elementwise"),
        (r"electra\.encoder\.layer\.\d+\.(attention\.output|output)\.LayerNorm\.(weight|bias)", "elementwise"),
        # source: ElectraDiscriminatorPredictions.forward: dense -> act -> dense_prediction -> squeeze ->
        # discriminator logits
        (r"discriminator_predictions\.dense\.weight", "hidden"),
        (r"discriminator_predictions\.dense_prediction\.weight", "head"),
        (r"discriminator_predictions\.(dense|dense_prediction)\.bias", "elementwise"),
    ],
    "DebertaV2ForSequenceClassification": [
        # source: models/deberta_v2/modeling_deberta_v2.py, DebertaV2Embeddings.forward: word_embeddings and
        # (position_biased_input=True) position_embeddings nn.Embedding lookups, summed; no token types
        # (type_vocab_size=0) and no rel_embeddings (relative_attention=False) in the default config
        (r"deberta\.embeddings\.(word|position)_embeddings\.weight", "table"),
        (r"deberta\.embeddings\.LayerNorm\.(weight|bias)", "elementwise"),
        # source: DisentangledSelfAttention.forward (query_proj/key_proj/value_proj), DebertaV2SelfOutput /
        # DebertaV2Intermediate / DebertaV2Output .forward (dense)
        (r"deberta\.encoder\.layer\.\d+\.attention\.self\.(query|key|value)_proj\.weight", "hidden"),
        (r"deberta\.encoder\.layer\.\d+\.(attention\.output|intermediate|output)\.dense\.weight", "hidden"),
        (r"deberta\.encoder\.layer\.\d+\.(attention\.self\.(query|key|value)_proj|attention\.output\.dense|intermediate\.dense|output\.dense)\.bias", "elementwise"),
        (r"deberta\.encoder\.layer\.\d+\.(attention\.output|output)\.LayerNorm\.(weight|bias)", "elementwise"),
        # source: ContextPooler.forward: dense(token 0) -> gelu; DebertaV2ForSequenceClassification.forward:
        # classifier(pooled_output) -> logits
        (r"pooler\.dense\.weight", "hidden"),
        (r"classifier\.weight", "head"),
        (r"(pooler\.dense|classifier)\.bias", "elementwise"),
    ],
    "AlbertForMaskedLM": [
        # source: models/albert/modeling_albert.py, AlbertEmbeddings.forward: nn.Embedding lookups, summed
        (r"albert\.embeddings\.(word|position|token_type)_embeddings\.weight", "table"),
        (r"albert\.embeddings\.LayerNorm\.(weight|bias)", "elementwise"),
        # source: AlbertTransformer.forward: embedding_hidden_mapping_in nn.Linear (128 -> 64)
        (r"albert\.encoder\.embedding_hidden_mapping_in\.weight", "hidden"),
        (r"albert\.encoder\.embedding_hidden_mapping_in\.bias", "elementwise"),
        # source: AlbertAttention.forward (query/key/value/dense) and AlbertLayer.forward (ffn, ffn_output);
        # the one shared layer group is applied num_hidden_layers times
        (r"albert\.encoder\.albert_layer_groups\.\d+\.albert_layers\.\d+\.attention\.(query|key|value|dense)\.weight", "hidden"),
        (r"albert\.encoder\.albert_layer_groups\.\d+\.albert_layers\.\d+\.(ffn|ffn_output)\.weight", "hidden"),
        (r"albert\.encoder\.albert_layer_groups\.\d+\.albert_layers\.\d+\.(attention\.(query|key|value|dense)|ffn|ffn_output)\.bias", "elementwise"),
        (r"albert\.encoder\.albert_layer_groups\.\d+\.albert_layers\.\d+\.(attention\.LayerNorm|full_layer_layer_norm)\.(weight|bias)", "elementwise"),
        # source: AlbertMLMHead.forward: dense -> act -> LayerNorm -> decoder -> logits; decoder.weight is
        # tied to word_embeddings (that name `table`, this one `head`); predictions.bias is decoder.bias
        (r"predictions\.dense\.weight", "hidden"),
        (r"predictions\.dense\.bias", "elementwise"),
        (r"predictions\.LayerNorm\.(weight|bias)", "elementwise"),
        (r"predictions\.decoder\.weight", "head"),
        (r"predictions\.(decoder\.)?bias", "elementwise"),
    ],
    "DistilBertForQuestionAnswering": [
        # source: models/distilbert/modeling_distilbert.py, Embeddings.forward: word and (learned,
        # sinusoidal_pos_embds=False) position nn.Embedding lookups, summed
        (r"distilbert\.embeddings\.(word|position)_embeddings\.weight", "table"),
        (r"distilbert\.embeddings\.LayerNorm\.(weight|bias)", "elementwise"),
        # source: DistilBertSelfAttention.forward (q_lin/k_lin/v_lin/out_lin), FFN.forward (lin1, lin2)
        (r"distilbert\.transformer\.layer\.\d+\.attention\.(q_lin|k_lin|v_lin|out_lin)\.weight", "hidden"),
        (r"distilbert\.transformer\.layer\.\d+\.ffn\.(lin1|lin2)\.weight", "hidden"),
        (r"distilbert\.transformer\.layer\.\d+\.(attention\.(q_lin|k_lin|v_lin|out_lin)|ffn\.(lin1|lin2))\.bias", "elementwise"),
        (r"distilbert\.transformer\.layer\.\d+\.(sa_layer_norm|output_layer_norm)\.(weight|bias)", "elementwise"),
        # source: DistilBertForQuestionAnswering.forward: qa_outputs -> start/end logits
        (r"qa_outputs\.weight", "head"),
        (r"qa_outputs\.bias", "elementwise"),
    ],
    "XLNetLMHeadModel": [
        # source: models/xlnet/modeling_xlnet.py, XLNetModel.forward: word_embedding(input_ids) (nn.Embedding)
        (r"transformer\.word_embedding\.weight", "table"),
        # source: XLNetModel.forward: mask_emb only builds the query stream when target_mapping is passed
        # (word_emb_q = mask_emb.expand(...)); default forward has target_mapping=None -> unused
        # (with target_mapping it is a token substituted into the query stream: table)
        (r"transformer\.mask_emb", "unused"),
        # source: XLNetRelativeAttention.forward: einsum("ibh,hnd->ibnd", h, q|k|v) and
        # einsum("ibh,hnd->ibnd", pos_emb, r), einsum("ibnd,hnd->ibh", attn_vec, o): each one matrix
        # [d_model x n_head*d_head] stored 3-D (one contraction over h, or over n,d for o), not a stack
        (r"transformer\.layer\.\d+\.rel_attn\.(q|k|v|o|r)", "hidden"),
        # source: XLNetRelativeAttention.rel_attn_core: q_head + r_w_bias / + r_r_bias (per-head vectors
        # added to q before the score einsums)
        (r"transformer\.layer\.\d+\.rel_attn\.(r_w_bias|r_r_bias)", "elementwise"),
        # source: rel_attn_core: `if seg_mat is None: ef = 0`; seg_mat is built only from token_type_ids,
        # which the default forward does not pass -> r_s_bias and seg_embed unused (with token_type_ids:
        # r_s_bias is added to q (elementwise) and seg_embed is contracted per head against q,
        # einsum("ibnd,snd->ibns"))
        (r"transformer\.layer\.\d+\.rel_attn\.(r_s_bias|seg_embed)", "unused"),
        (r"transformer\.layer\.\d+\.(rel_attn|ff)\.layer_norm\.(weight|bias)", "elementwise"),
        # source: XLNetFeedForward.forward: layer_1 -> act -> layer_2
        (r"transformer\.layer\.\d+\.ff\.(layer_1|layer_2)\.weight", "hidden"),
        (r"transformer\.layer\.\d+\.ff\.(layer_1|layer_2)\.bias", "elementwise"),
        # source: XLNetLMHeadModel.forward: logits = lm_loss(transformer_outputs[0]); tied to word_embedding
        (r"lm_loss\.weight", "head"),
        (r"lm_loss\.bias", "elementwise"),
    ],
    "MPNetForMaskedLM": [
        # source: models/mpnet/modeling_mpnet.py, MPNetEmbeddings.forward: word and position nn.Embedding
        (r"mpnet\.embeddings\.(word|position)_embeddings\.weight", "table"),
        (r"mpnet\.embeddings\.LayerNorm\.(weight|bias)", "elementwise"),
        # source: MPNetSelfAttention.forward (q/k/v/o), MPNetIntermediate / MPNetOutput .forward (dense)
        (r"mpnet\.encoder\.layer\.\d+\.attention\.attn\.(q|k|v|o)\.weight", "hidden"),
        (r"mpnet\.encoder\.layer\.\d+\.(intermediate|output)\.dense\.weight", "hidden"),
        (r"mpnet\.encoder\.layer\.\d+\.(attention\.attn\.(q|k|v|o)|intermediate\.dense|output\.dense)\.bias", "elementwise"),
        (r"mpnet\.encoder\.layer\.\d+\.(attention|output)\.LayerNorm\.(weight|bias)", "elementwise"),
        # source: MPNetEncoder.compute_position_bias: relative_attention_bias(rp_bucket) (nn.Embedding indexed
        # by bucketed relative positions), added to the attention scores
        (r"mpnet\.encoder\.relative_attention_bias\.weight", "table"),
        # source: MPNetLMHead.forward: dense -> gelu -> layer_norm -> decoder -> logits; decoder.weight tied to
        # word_embeddings; lm_head.bias is decoder.bias
        (r"lm_head\.dense\.weight", "hidden"),
        (r"lm_head\.dense\.bias", "elementwise"),
        (r"lm_head\.layer_norm\.(weight|bias)", "elementwise"),
        (r"lm_head\.decoder\.weight", "head"),
        (r"lm_head\.(decoder\.)?bias", "elementwise"),
    ],
    # ======================================================================================
    # Encoder-decoders
    # ======================================================================================
    "T5ForConditionalGeneration": [
        # source: models/t5/modeling_t5.py, T5Stack.forward: embed_tokens(input_ids); shared, encoder and
        # decoder embed_tokens are one tensor (tie_word_embeddings=True) under three names
        (r"(shared|encoder\.embed_tokens|decoder\.embed_tokens)\.weight", "table"),
        # source: T5Attention.forward: q/k/v/o nn.Linear (self and cross attention)
        (r"(encoder|decoder)\.block\.\d+\.layer\.\d+\.(SelfAttention|EncDecAttention)\.(q|k|v|o)\.weight", "hidden"),
        # source: T5Attention.compute_bias: relative_attention_bias(relative_position_bucket) (nn.Embedding,
        # first block of each stack), added to the scores
        (r"(encoder|decoder)\.block\.\d+\.layer\.\d+\.SelfAttention\.relative_attention_bias\.weight", "table"),
        # source: T5DenseActDense.forward: wi -> relu -> wo
        (r"(encoder|decoder)\.block\.\d+\.layer\.\d+\.DenseReluDense\.(wi|wo)\.weight", "hidden"),
        # source: T5LayerNorm.forward: weight * normalised hidden states
        (r"(encoder|decoder)\.block\.\d+\.layer\.\d+\.layer_norm\.weight", "elementwise"),
        (r"(encoder|decoder)\.final_layer_norm\.weight", "elementwise"),
        # source: T5ForConditionalGeneration.forward: lm_head(sequence_output * d_model**-0.5) -> logits;
        # tied to shared
        (r"lm_head\.weight", "head"),
    ],
    "BartForSequenceClassification": [
        # source: models/bart/modeling_bart.py, BartScaledWordEmbedding (nn.Embedding); shared and the
        # encoder/decoder embed_tokens are one tensor under three names
        (r"model\.(shared|encoder\.embed_tokens|decoder\.embed_tokens)\.weight", "table"),
        # source: BartLearnedPositionalEmbedding.forward: nn.Embedding read at positions + offset 2
        (r"model\.(encoder|decoder)\.embed_positions\.weight", "table"),
        (r"model\.(encoder|decoder)\.layernorm_embedding\.(weight|bias)", "elementwise"),
        # source: BartAttention.forward (q/k/v/out_proj), BartEncoderLayer / BartDecoderLayer .forward (fc1,
        # fc2); the encoder output feeds the decoder's cross-attention k/v
        (r"model\.(encoder|decoder)\.layers\.\d+\.(self_attn|encoder_attn)\.(q_proj|k_proj|v_proj|out_proj)\.weight", "hidden"),
        (r"model\.(encoder|decoder)\.layers\.\d+\.(fc1|fc2)\.weight", "hidden"),
        (r"model\.(encoder|decoder)\.layers\.\d+\.((self_attn|encoder_attn)\.(q_proj|k_proj|v_proj|out_proj)|fc1|fc2)\.bias", "elementwise"),
        (r"model\.(encoder|decoder)\.layers\.\d+\.(self_attn_layer_norm|encoder_attn_layer_norm|final_layer_norm)\.(weight|bias)", "elementwise"),
        # source: BartClassificationHead.forward: dense(eos hidden state) -> tanh -> out_proj -> logits
        (r"classification_head\.dense\.weight", "hidden"),
        (r"classification_head\.out_proj\.weight", "head"),
        (r"classification_head\.(dense|out_proj)\.bias", "elementwise"),
    ],
    "MarianMTModel": [
        # source: models/marian/modeling_marian.py, MarianEncoder/MarianDecoder .forward: embed_tokens
        # (nn.Embedding, scaled); shared, encoder/decoder embed_tokens are one tensor. The sinusoidal
        # embed_positions are frozen (requires_grad=False) and so not listed
        (r"model\.(shared|encoder\.embed_tokens|decoder\.embed_tokens)\.weight", "table"),
        # source: MarianAttention.forward (q/k/v/out_proj), MarianEncoderLayer / MarianDecoderLayer (fc1, fc2)
        (r"model\.(encoder|decoder)\.layers\.\d+\.(self_attn|encoder_attn)\.(q_proj|k_proj|v_proj|out_proj)\.weight", "hidden"),
        (r"model\.(encoder|decoder)\.layers\.\d+\.(fc1|fc2)\.weight", "hidden"),
        (r"model\.(encoder|decoder)\.layers\.\d+\.((self_attn|encoder_attn)\.(q_proj|k_proj|v_proj|out_proj)|fc1|fc2)\.bias", "elementwise"),
        (r"model\.(encoder|decoder)\.layers\.\d+\.(self_attn_layer_norm|encoder_attn_layer_norm|final_layer_norm)\.(weight|bias)", "elementwise"),
        # source: MarianMTModel.forward: lm_head(outputs[0]) + final_logits_bias (a buffer) -> logits; tied
        # to shared
        (r"lm_head\.weight", "head"),
    ],
    "WhisperForConditionalGeneration": [
        # source: models/whisper/modeling_whisper.py, WhisperEncoder.forward: conv1 (input layer on the
        # log-mel input_features) -> gelu -> conv2 -> gelu; the encoder embed_positions is frozen (not listed)
        (r"model\.encoder\.(conv1|conv2)\.weight", "hidden"),
        (r"model\.encoder\.(conv1|conv2)\.bias", "elementwise"),
        # source: WhisperDecoder.forward: embed_tokens (nn.Embedding, tied to proj_out) and
        # WhisperPositionalEmbedding (nn.Embedding whose rows are read at the positions)
        (r"model\.decoder\.(embed_tokens|embed_positions)\.weight", "table"),
        # source: WhisperAttention.forward (q/k/v/out_proj; k_proj has no bias), WhisperEncoderLayer /
        # WhisperDecoderLayer .forward (fc1, fc2)
        (r"model\.(encoder|decoder)\.layers\.\d+\.(self_attn|encoder_attn)\.(q_proj|k_proj|v_proj|out_proj)\.weight", "hidden"),
        (r"model\.(encoder|decoder)\.layers\.\d+\.(fc1|fc2)\.weight", "hidden"),
        (r"model\.(encoder|decoder)\.layers\.\d+\.((self_attn|encoder_attn)\.(q_proj|v_proj|out_proj)|fc1|fc2)\.bias", "elementwise"),
        (r"model\.(encoder|decoder)\.layers\.\d+\.(self_attn_layer_norm|encoder_attn_layer_norm|final_layer_norm)\.(weight|bias)", "elementwise"),
        (r"model\.(encoder|decoder)\.layer_norm\.(weight|bias)", "elementwise"),
        # source: WhisperForConditionalGeneration.forward: proj_out(outputs[0]) -> logits; tied to
        # decoder.embed_tokens
        (r"proj_out\.weight", "head"),
    ],
    # ======================================================================================
    # Vision
    # ======================================================================================
    "ViTForImageClassification": [
        # source: models/vit/modeling_vit.py, ViTEmbeddings.forward: cat((cls_token, patches)) then
        # + position_embeddings [1, 197, 64]
        (r"vit\.embeddings\.(cls_token|position_embeddings)", "table"),
        # source: ViTPatchEmbeddings.forward: projection Conv2d on pixel_values (input layer)
        (r"vit\.embeddings\.patch_embeddings\.projection\.weight", "hidden"),
        (r"vit\.embeddings\.patch_embeddings\.projection\.bias", "elementwise"),
        # source: ViTAttention.forward (q/k/v/o_proj), ViTMLP.forward (fc1, fc2)
        (r"vit\.layers\.\d+\.attention\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        (r"vit\.layers\.\d+\.mlp\.(fc1|fc2)\.weight", "hidden"),
        (r"vit\.layers\.\d+\.(attention\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(fc1|fc2))\.bias", "elementwise"),
        (r"vit\.layers\.\d+\.(layernorm_before|layernorm_after)\.(weight|bias)", "elementwise"),
        (r"vit\.layernorm\.(weight|bias)", "elementwise"),
        # source: ViTForImageClassification.forward: classifier(sequence_output[:, 0]) -> logits
        (r"classifier\.weight", "head"),
        (r"classifier\.bias", "elementwise"),
    ],
    "DeiTForImageClassificationWithTeacher": [
        # source: models/deit/modeling_deit.py, DeiTEmbeddings.forward: cat((cls_token, distillation_token,
        # patches)) + position_embeddings [1, 198, 64]
        (r"deit\.embeddings\.(cls_token|distillation_token|position_embeddings)", "table"),
        (r"deit\.embeddings\.patch_embeddings\.projection\.weight", "hidden"),
        (r"deit\.embeddings\.patch_embeddings\.projection\.bias", "elementwise"),
        # source: DeiTAttention.forward (q/k/v/o_proj), DeiTMLP.forward (fc1, fc2)
        (r"deit\.layers\.\d+\.attention\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        (r"deit\.layers\.\d+\.mlp\.(fc1|fc2)\.weight", "hidden"),
        (r"deit\.layers\.\d+\.(attention\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(fc1|fc2))\.bias", "elementwise"),
        (r"deit\.layers\.\d+\.(layernorm_before|layernorm_after)\.(weight|bias)", "elementwise"),
        (r"deit\.layernorm\.(weight|bias)", "elementwise"),
        # source: DeiTForImageClassificationWithTeacher.forward: cls_classifier(token 0) -> cls_logits,
        # distillation_classifier(token 1) -> distillation_logits, logits = their average
        (r"(cls_classifier|distillation_classifier)\.weight", "head"),
        (r"(cls_classifier|distillation_classifier)\.bias", "elementwise"),
    ],
    "SwinForImageClassification": [
        # source: models/swin/modeling_swin.py, SwinPatchEmbeddings.forward: projection Conv2d on pixel_values;
        # SwinEmbeddings.forward: norm (no absolute position table: use_absolute_embeddings=False)
        (r"swin\.embeddings\.patch_embeddings\.projection\.weight", "hidden"),
        (r"swin\.embeddings\.patch_embeddings\.projection\.bias", "elementwise"),
        (r"swin\.embeddings\.norm\.(weight|bias)", "elementwise"),
        # source: SwinAttention.forward (q/k/v/o_proj), SwinMLP.forward (fc1, fc2)
        (r"swin\.encoder\.layers\.\d+\.blocks\.\d+\.attention\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        (r"swin\.encoder\.layers\.\d+\.blocks\.\d+\.mlp\.(fc1|fc2)\.weight", "hidden"),
        (r"swin\.encoder\.layers\.\d+\.blocks\.\d+\.(attention\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(fc1|fc2))\.bias", "elementwise"),
        (r"swin\.encoder\.layers\.\d+\.blocks\.\d+\.(layernorm_before|layernorm_after)\.(weight|bias)", "elementwise"),
        # source: SwinRelativePositionBias.forward: relative_position_bias_table[relative_position_index]
        (r"swin\.encoder\.layers\.\d+\.blocks\.\d+\.attention\.relative_position_bias\.relative_position_bias_table", "table"),
        # source: SwinPatchMerging.forward: norm -> reduction nn.Linear(4C -> 2C, no bias)
        (r"swin\.encoder\.layers\.\d+\.downsample\.reduction\.weight", "hidden"),
        (r"swin\.encoder\.layers\.\d+\.downsample\.norm\.(weight|bias)", "elementwise"),
        # source: SwinModel.forward: layernorm -> AdaptiveAvgPool1d; SwinForImageClassification.forward:
        # classifier(pooled_output) -> logits
        (r"swin\.layernorm\.(weight|bias)", "elementwise"),
        (r"classifier\.weight", "head"),
        (r"classifier\.bias", "elementwise"),
    ],
    "ConvNextV2ForImageClassification": [
        # source: models/convnextv2/modeling_convnextv2.py, ConvNextV2Embeddings.forward: patch_embeddings
        # Conv2d (4x4 stride 4) on pixel_values -> layernorm
        (r"convnextv2\.embeddings\.patch_embeddings\.weight", "hidden"),
        (r"convnextv2\.embeddings\.patch_embeddings\.bias", "elementwise"),
        (r"convnextv2\.embeddings\.layernorm\.(weight|bias)", "elementwise"),
        # source: ConvNextV2Layer.forward: dwconv (Conv2d groups=dim, weight [C, 1, 7, 7])
        (r"convnextv2\.encoder\.stages\.\d+\.layers\.\d+\.dwconv\.weight", "depthwise"),
        (r"convnextv2\.encoder\.stages\.\d+\.layers\.\d+\.dwconv\.bias", "elementwise"),
        (r"convnextv2\.encoder\.stages\.\d+\.layers\.\d+\.layernorm\.(weight|bias)", "elementwise"),
        # source: ConvNextV2Layer.forward: pwconv1 / pwconv2 nn.Linear on channels-last features
        (r"convnextv2\.encoder\.stages\.\d+\.layers\.\d+\.(pwconv1|pwconv2)\.weight", "hidden"),
        (r"convnextv2\.encoder\.stages\.\d+\.layers\.\d+\.(pwconv1|pwconv2)\.bias", "elementwise"),
        # source: ConvNextV2GRN.forward: weight * (x * norm_features) + bias + x ([1, 1, 1, C] gains)
        (r"convnextv2\.encoder\.stages\.\d+\.layers\.\d+\.grn\.(weight|bias)", "elementwise"),
        # source: ConvNextV2Stage.forward: downsampling_layer = [ConvNextV2LayerNorm, Conv2d(k=2, s=2)]
        (r"convnextv2\.encoder\.stages\.\d+\.downsampling_layer\.0\.(weight|bias)", "elementwise"),
        (r"convnextv2\.encoder\.stages\.\d+\.downsampling_layer\.1\.weight", "hidden"),
        (r"convnextv2\.encoder\.stages\.\d+\.downsampling_layer\.1\.bias", "elementwise"),
        # source: ConvNextV2Model.forward: layernorm(mean over H, W); ConvNextV2ForImageClassification.forward:
        # classifier(pooled_output) -> logits
        (r"convnextv2\.layernorm\.(weight|bias)", "elementwise"),
        (r"classifier\.weight", "head"),
        (r"classifier\.bias", "elementwise"),
    ],
    "ConvNextForImageClassification": [
        # source: models/convnext/modeling_convnext.py, ConvNextEmbeddings.forward: patch_embeddings Conv2d on
        # pixel_values -> layernorm
        (r"convnext\.embeddings\.patch_embeddings\.weight", "hidden"),
        (r"convnext\.embeddings\.patch_embeddings\.bias", "elementwise"),
        (r"convnext\.embeddings\.layernorm\.(weight|bias)", "elementwise"),
        # source: ConvNextLayer.forward: dwconv (depthwise) -> layernorm -> pwconv1 -> act -> pwconv2 ->
        # layer_scale_parameter * x ([C] gain)
        (r"convnext\.encoder\.stages\.\d+\.layers\.\d+\.dwconv\.weight", "depthwise"),
        (r"convnext\.encoder\.stages\.\d+\.layers\.\d+\.dwconv\.bias", "elementwise"),
        (r"convnext\.encoder\.stages\.\d+\.layers\.\d+\.layernorm\.(weight|bias)", "elementwise"),
        (r"convnext\.encoder\.stages\.\d+\.layers\.\d+\.(pwconv1|pwconv2)\.weight", "hidden"),
        (r"convnext\.encoder\.stages\.\d+\.layers\.\d+\.(pwconv1|pwconv2)\.bias", "elementwise"),
        (r"convnext\.encoder\.stages\.\d+\.layers\.\d+\.layer_scale_parameter", "elementwise"),
        # source: ConvNextStage.forward: downsampling_layer = [ConvNextLayerNorm, Conv2d(k=2, s=2)]
        (r"convnext\.encoder\.stages\.\d+\.downsampling_layer\.0\.(weight|bias)", "elementwise"),
        (r"convnext\.encoder\.stages\.\d+\.downsampling_layer\.1\.weight", "hidden"),
        (r"convnext\.encoder\.stages\.\d+\.downsampling_layer\.1\.bias", "elementwise"),
        # source: ConvNextModel.forward: layernorm(mean); ConvNextForImageClassification.forward: classifier
        (r"convnext\.layernorm\.(weight|bias)", "elementwise"),
        (r"classifier\.weight", "head"),
        (r"classifier\.bias", "elementwise"),
    ],
    "BeitForImageClassification": [
        # source: models/beit/modeling_beit.py, BeitEmbeddings.forward: cat((cls_token, patches)); no mask
        # token / absolute / relative position tables in the default config
        (r"beit\.embeddings\.cls_token", "table"),
        (r"beit\.embeddings\.patch_embeddings\.projection\.weight", "hidden"),
        (r"beit\.embeddings\.patch_embeddings\.projection\.bias", "elementwise"),
        # source: BeitAttention.forward (q/k/v/o_proj; k_proj has no bias), BeitMLP.forward (fc1, fc2)
        (r"beit\.layers\.\d+\.attention\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        (r"beit\.layers\.\d+\.mlp\.(fc1|fc2)\.weight", "hidden"),
        (r"beit\.layers\.\d+\.(attention\.(q_proj|v_proj|o_proj)|mlp\.(fc1|fc2))\.bias", "elementwise"),
        (r"beit\.layers\.\d+\.(layernorm_before|layernorm_after)\.(weight|bias)", "elementwise"),
        # source: BeitLayer.forward: lambda_1 * attention_output, lambda_2 * layer_output (layer scales)
        (r"beit\.layers\.\d+\.(lambda_1|lambda_2)", "elementwise"),
        # source: BeitPooler.forward: layernorm(mean of patch tokens) (use_mean_pooling=True);
        # BeitForImageClassification.forward: classifier(pooled_output) -> logits
        (r"beit\.pooler\.layernorm\.(weight|bias)", "elementwise"),
        (r"classifier\.weight", "head"),
        (r"classifier\.bias", "elementwise"),
    ],
    "ViTMAEForPreTraining": [
        # source: models/vit_mae/modeling_vit_mae.py, ViTMAEEmbeddings.forward: cls_token (+ its frozen
        # position row) concatenated in front of the kept patches; the sincos position tables are frozen
        (r"vit\.embeddings\.cls_token", "table"),
        (r"vit\.embeddings\.patch_embeddings\.projection\.weight", "hidden"),
        (r"vit\.embeddings\.patch_embeddings\.projection\.bias", "elementwise"),
        # source: ViTMAEAttention.forward (q/k/v/o_proj), ViTMAEMLP.forward (fc1, fc2): encoder and decoder
        (r"(vit\.layers|decoder\.decoder_layers)\.\d+\.attention\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        (r"(vit\.layers|decoder\.decoder_layers)\.\d+\.mlp\.(fc1|fc2)\.weight", "hidden"),
        (r"(vit\.layers|decoder\.decoder_layers)\.\d+\.(attention\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(fc1|fc2))\.bias", "elementwise"),
        (r"(vit\.layers|decoder\.decoder_layers)\.\d+\.(layernorm_before|layernorm_after)\.(weight|bias)", "elementwise"),
        (r"vit\.layernorm\.(weight|bias)", "elementwise"),
        # source: ViTMAEDecoder.forward: decoder_embed nn.Linear (encoder width -> decoder width)
        (r"decoder\.decoder_embed\.weight", "hidden"),
        (r"decoder\.decoder_embed\.bias", "elementwise"),
        # source: ViTMAEDecoder.forward: mask_token repeated and concatenated after the kept tokens, then
        # unshuffled with torch.gather(ids_restore): a token entering the sequence
        (r"decoder\.mask_token", "table"),
        # source: ViTMAEDecoder.forward: decoder_norm -> decoder_pred -> logits (pixel predictions)
        (r"decoder\.decoder_norm\.(weight|bias)", "elementwise"),
        (r"decoder\.decoder_pred\.weight", "head"),
        (r"decoder\.decoder_pred\.bias", "elementwise"),
    ],
    "Dinov2ForImageClassification": [
        # source: models/dinov2/modeling_dinov2.py, Dinov2Embeddings.forward: cat((cls_token, patches)) +
        # interpolated position_embeddings [1, 257, 64]
        (r"dinov2\.embeddings\.(cls_token|position_embeddings)", "table"),
        # source: Dinov2Embeddings.forward: `if bool_masked_pos is not None: torch.where(..., mask_token, ...)`;
        # the default forward passes no bool_masked_pos -> unused (when passed: a mask token substituted at
        # masked positions, i.e. table)
        (r"dinov2\.embeddings\.mask_token", "unused"),
        (r"dinov2\.embeddings\.patch_embeddings\.projection\.weight", "hidden"),
        (r"dinov2\.embeddings\.patch_embeddings\.projection\.bias", "elementwise"),
        # source: Dinov2Attention.forward (q/k/v/o_proj), Dinov2MLP.forward (fc1, fc2)
        (r"dinov2\.encoder\.layer\.\d+\.attention\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        (r"dinov2\.encoder\.layer\.\d+\.mlp\.(fc1|fc2)\.weight", "hidden"),
        (r"dinov2\.encoder\.layer\.\d+\.(attention\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(fc1|fc2))\.bias", "elementwise"),
        (r"dinov2\.encoder\.layer\.\d+\.(norm1|norm2)\.(weight|bias)", "elementwise"),
        # source: Dinov2LayerScale.forward: hidden_state * lambda1
        (r"dinov2\.encoder\.layer\.\d+\.(layer_scale1|layer_scale2)\.lambda1", "elementwise"),
        (r"dinov2\.layernorm\.(weight|bias)", "elementwise"),
        # source: Dinov2ForImageClassification.forward: classifier(cat([cls_token, patch_tokens.mean]))
        (r"classifier\.weight", "head"),
        (r"classifier\.bias", "elementwise"),
    ],
    "MobileNetV2ForImageClassification": [
        # source: models/mobilenet_v2/modeling_mobilenet_v2.py, MobileNetV2Stem.forward: first_conv (3x3
        # stride 2 on pixel_values, input layer) -> conv_3x3 (groups=32: depthwise) -> reduce_1x1
        (r"mobilenet_v2\.conv_stem\.first_conv\.convolution\.weight", "hidden"),
        (r"mobilenet_v2\.conv_stem\.conv_3x3\.convolution\.weight", "depthwise"),
        (r"mobilenet_v2\.conv_stem\.reduce_1x1\.convolution\.weight", "hidden"),
        # source: MobileNetV2InvertedResidual.forward: expand_1x1 -> conv_3x3 (groups=expanded channels:
        # depthwise) -> reduce_1x1
        (r"mobilenet_v2\.layer\.\d+\.(expand_1x1|reduce_1x1)\.convolution\.weight", "hidden"),
        (r"mobilenet_v2\.layer\.\d+\.conv_3x3\.convolution\.weight", "depthwise"),
        # source: MobileNetV2Model.forward: conv_1x1 (320 -> 1280) -> AdaptiveAvgPool -> classifier
        (r"mobilenet_v2\.conv_1x1\.convolution\.weight", "hidden"),
        # source: MobileNetV2ConvLayer.forward: BatchNorm2d after every conv (convs have no bias)
        (r"mobilenet_v2\.(conv_stem\.(first_conv|conv_3x3|reduce_1x1)|layer\.\d+\.(expand_1x1|conv_3x3|reduce_1x1)|conv_1x1)\.normalization\.(weight|bias)", "elementwise"),
        # source: MobileNetV2ForImageClassification.forward: classifier(dropout(pooled_output)) -> logits
        (r"classifier\.weight", "head"),
        (r"classifier\.bias", "elementwise"),
    ],
    "SegformerForSemanticSegmentation": [
        # source: models/segformer/modeling_segformer.py, SegformerOverlapPatchEmbeddings.forward: proj Conv2d
        # (stage 0 on pixel_values, later stages on the previous stage's map) -> layer_norm
        (r"segformer\.stages\.\d+\.patch_embeddings\.proj\.weight", "hidden"),
        (r"segformer\.stages\.\d+\.patch_embeddings\.proj\.bias", "elementwise"),
        (r"segformer\.stages\.\d+\.patch_embeddings\.layer_norm\.(weight|bias)", "elementwise"),
        # source: SegformerAttention.forward: q/k/v/o_proj nn.Linear
        (r"segformer\.stages\.\d+\.blocks\.\d+\.attention\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        (r"segformer\.stages\.\d+\.blocks\.\d+\.attention\.(q_proj|k_proj|v_proj|o_proj)\.bias", "elementwise"),
        # source: SegformerSequenceReduction.forward: Conv2d(C, C, k=sr, stride=sr, groups=1) -> layer_norm,
        # feeding k_proj / v_proj
        (r"segformer\.stages\.\d+\.blocks\.\d+\.attention\.sequence_reduction\.sequence_reduction\.weight", "hidden"),
        (r"segformer\.stages\.\d+\.blocks\.\d+\.attention\.sequence_reduction\.sequence_reduction\.bias", "elementwise"),
        (r"segformer\.stages\.\d+\.blocks\.\d+\.attention\.sequence_reduction\.layer_norm\.(weight|bias)", "elementwise"),
        (r"segformer\.stages\.\d+\.blocks\.\d+\.(layernorm_before|layernorm_after)\.(weight|bias)", "elementwise"),
        # source: SegformerMixMLP.forward: fc1 -> SegformerDepthWiseConv (Conv2d groups=dim) -> act -> fc2
        (r"segformer\.stages\.\d+\.blocks\.\d+\.mlp\.(fc1|fc2)\.weight", "hidden"),
        (r"segformer\.stages\.\d+\.blocks\.\d+\.mlp\.dwconv\.dwconv\.weight", "depthwise"),
        (r"segformer\.stages\.\d+\.blocks\.\d+\.mlp\.(fc1|fc2|dwconv\.dwconv)\.bias", "elementwise"),
        (r"segformer\.stages\.\d+\.layer_norm\.(weight|bias)", "elementwise"),
        # source: SegformerDecodeHead.forward: linear_projections[i] (SegformerMLP: proj nn.Linear) ->
        # upsample -> cat -> linear_fuse (1x1 Conv2d, no bias) -> batch_norm -> act -> classifier (1x1 Conv2d)
        # -> logits
        (r"decode_head\.linear_projections\.\d+\.proj\.weight", "hidden"),
        (r"decode_head\.linear_projections\.\d+\.proj\.bias", "elementwise"),
        (r"decode_head\.linear_fuse\.weight", "hidden"),
        (r"decode_head\.batch_norm\.(weight|bias)", "elementwise"),
        (r"decode_head\.classifier\.weight", "head"),
        (r"decode_head\.classifier\.bias", "elementwise"),
    ],
    # ======================================================================================
    # Audio
    # ======================================================================================
    "Wav2Vec2ForCTC": [
        # source: models/wav2vec2/modeling_wav2vec2.py, Wav2Vec2Model._mask_hidden_states:
        # `hidden_states[mask_time_indices] = masked_spec_embed` (mask_time_prob=0.05 and the model as built
        # is in training mode): a mask vector substituted at masked time steps
        (r"wav2vec2\.masked_spec_embed", "table"),
        # source: Wav2Vec2FeatureEncoder.forward: conv_layers[0] Conv1d on raw audio (input layer), then the
        # other Conv1d layers (no bias); Wav2Vec2GroupNormConvLayer: GroupNorm on layer 0 only
        (r"wav2vec2\.feature_extractor\.conv_layers\.\d+\.conv\.weight", "hidden"),
        (r"wav2vec2\.feature_extractor\.conv_layers\.0\.layer_norm\.(weight|bias)", "elementwise"),
        # source: Wav2Vec2FeatureProjection.forward: layer_norm -> projection nn.Linear (512 -> 64)
        (r"wav2vec2\.feature_projection\.layer_norm\.(weight|bias)", "elementwise"),
        (r"wav2vec2\.feature_projection\.projection\.weight", "hidden"),
        (r"wav2vec2\.feature_projection\.projection\.bias", "elementwise"),
        # source: Wav2Vec2PositionalConvEmbedding: conv = weight_norm(Conv1d(64, 64, 128, groups=16), dim=2);
        # original1 is the direction v (grouped conv weight), original0 the magnitude g [1, 1, 128]
        (r"wav2vec2\.encoder\.pos_conv_embed\.conv\.parametrizations\.weight\.original1", "hidden"),
        (r"wav2vec2\.encoder\.pos_conv_embed\.conv\.parametrizations\.weight\.original0", "elementwise"),
        (r"wav2vec2\.encoder\.pos_conv_embed\.conv\.bias", "elementwise"),
        (r"wav2vec2\.encoder\.layer_norm\.(weight|bias)", "elementwise"),
        # source: Wav2Vec2Attention.forward (q/k/v/out_proj), Wav2Vec2FeedForward.forward
        # (intermediate_dense, output_dense)
        (r"wav2vec2\.encoder\.layers\.\d+\.attention\.(q_proj|k_proj|v_proj|out_proj)\.weight", "hidden"),
        (r"wav2vec2\.encoder\.layers\.\d+\.feed_forward\.(intermediate_dense|output_dense)\.weight", "hidden"),
        (r"wav2vec2\.encoder\.layers\.\d+\.(attention\.(q_proj|k_proj|v_proj|out_proj)|feed_forward\.(intermediate_dense|output_dense))\.bias", "elementwise"),
        (r"wav2vec2\.encoder\.layers\.\d+\.(layer_norm|final_layer_norm)\.(weight|bias)", "elementwise"),
        # source: Wav2Vec2ForCTC.forward: lm_head(hidden_states) -> CTC logits
        (r"lm_head\.weight", "head"),
        (r"lm_head\.bias", "elementwise"),
    ],
    "HubertForSequenceClassification": [
        # source: models/hubert/modeling_hubert.py, HubertModel._mask_hidden_states: masked_spec_embed
        # written at masked time steps (training mode, mask_time_prob=0.05)
        (r"hubert\.masked_spec_embed", "table"),
        # source: HubertFeatureEncoder.forward: Conv1d stack on raw audio; GroupNorm on layer 0 only
        (r"hubert\.feature_extractor\.conv_layers\.\d+\.conv\.weight", "hidden"),
        (r"hubert\.feature_extractor\.conv_layers\.0\.layer_norm\.(weight|bias)", "elementwise"),
        # source: HubertFeatureProjection.forward: layer_norm (feat_proj_layer_norm) -> projection
        (r"hubert\.feature_projection\.layer_norm\.(weight|bias)", "elementwise"),
        (r"hubert\.feature_projection\.projection\.weight", "hidden"),
        (r"hubert\.feature_projection\.projection\.bias", "elementwise"),
        # source: HubertPositionalConvEmbedding: weight_norm(Conv1d(groups=16), dim=2): v grouped conv
        # weight, g magnitude
        (r"hubert\.encoder\.pos_conv_embed\.conv\.parametrizations\.weight\.original1", "hidden"),
        (r"hubert\.encoder\.pos_conv_embed\.conv\.parametrizations\.weight\.original0", "elementwise"),
        (r"hubert\.encoder\.pos_conv_embed\.conv\.bias", "elementwise"),
        (r"hubert\.encoder\.layer_norm\.(weight|bias)", "elementwise"),
        # source: HubertAttention.forward, HubertFeedForward.forward
        (r"hubert\.encoder\.layers\.\d+\.attention\.(q_proj|k_proj|v_proj|out_proj)\.weight", "hidden"),
        (r"hubert\.encoder\.layers\.\d+\.feed_forward\.(intermediate_dense|output_dense)\.weight", "hidden"),
        (r"hubert\.encoder\.layers\.\d+\.(attention\.(q_proj|k_proj|v_proj|out_proj)|feed_forward\.(intermediate_dense|output_dense))\.bias", "elementwise"),
        (r"hubert\.encoder\.layers\.\d+\.(layer_norm|final_layer_norm)\.(weight|bias)", "elementwise"),
        # source: HubertForSequenceClassification.forward: projector -> mean over time -> classifier -> logits
        (r"projector\.weight", "hidden"),
        (r"classifier\.weight", "head"),
        (r"(projector|classifier)\.bias", "elementwise"),
    ],
    "ASTForAudioClassification": [
        # source: models/audio_spectrogram_transformer/modeling_audio_spectrogram_transformer.py,
        # ASTEmbeddings.forward: cat((cls_token, distillation_token, patches)) + position_embeddings
        (r"audio_spectrogram_transformer\.embeddings\.(cls_token|distillation_token|position_embeddings)", "table"),
        # source: ASTPatchEmbeddings.forward: projection Conv2d(1 -> 64) on the spectrogram (input layer)
        (r"audio_spectrogram_transformer\.embeddings\.patch_embeddings\.projection\.weight", "hidden"),
        (r"audio_spectrogram_transformer\.embeddings\.patch_embeddings\.projection\.bias", "elementwise"),
        # source: ASTAttention.forward (q/k/v/o_proj), ASTMLP.forward (fc1, fc2)
        (r"audio_spectrogram_transformer\.layers\.\d+\.attention\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        (r"audio_spectrogram_transformer\.layers\.\d+\.mlp\.(fc1|fc2)\.weight", "hidden"),
        (r"audio_spectrogram_transformer\.layers\.\d+\.(attention\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(fc1|fc2))\.bias", "elementwise"),
        (r"audio_spectrogram_transformer\.layers\.\d+\.(layernorm_before|layernorm_after)\.(weight|bias)", "elementwise"),
        (r"audio_spectrogram_transformer\.layernorm\.(weight|bias)", "elementwise"),
        # source: ASTModel.forward: pooled = (token 0 + token 1) / 2; ASTMLPHead.forward: layernorm -> dense
        # -> logits
        (r"classifier\.layernorm\.(weight|bias)", "elementwise"),
        (r"classifier\.dense\.weight", "head"),
        (r"classifier\.dense\.bias", "elementwise"),
    ],
    # ======================================================================================
    # SSM / hybrid
    # ======================================================================================
    "Mamba2ForCausalLM": [
        # source: models/mamba2/modeling_mamba2.py, Mamba2Model.forward: embeddings(input_ids) (nn.Embedding)
        (r"backbone\.embeddings\.weight", "table"),
        # source: Mamba2Block.forward: norm (RMSNorm) -> mixer; Mamba2Model.forward: norm_f
        (r"backbone\.layers\.\d+\.norm\.weight", "elementwise"),
        (r"backbone\.norm_f\.weight", "elementwise"),
        # source: Mamba2Mixer.torch_forward: in_proj (fused z/xBC/dt projection) -> conv1d (groups=conv_dim:
        # depthwise) -> SSM scan with dt_bias (softplus(dt + dt_bias)), A = -exp(A_log), D skip -> gated
        # norm (MambaRMSNormGated weight) -> out_proj
        (r"backbone\.layers\.\d+\.mixer\.(in_proj|out_proj)\.weight", "hidden"),
        (r"backbone\.layers\.\d+\.mixer\.conv1d\.weight", "depthwise"),
        (r"backbone\.layers\.\d+\.mixer\.conv1d\.bias", "elementwise"),
        (r"backbone\.layers\.\d+\.mixer\.(dt_bias|A_log|D)", "elementwise"),
        (r"backbone\.layers\.\d+\.mixer\.norm\.weight", "elementwise"),
        # source: Mamba2ForCausalLM.forward: lm_head(hidden_states) -> logits (not tied in this config)
        (r"lm_head\.weight", "head"),
    ],
    "RwkvForCausalLM": [
        # source: models/rwkv/modeling_rwkv.py, RwkvModel.forward: embeddings(input_ids) (nn.Embedding)
        (r"rwkv\.embeddings\.weight", "table"),
        # source: RwkvBlock.forward: pre_ln (block 0 only), ln1 -> attention, ln2 -> feed_forward
        (r"rwkv\.blocks\.\d+\.(pre_ln|ln1|ln2)\.(weight|bias)", "elementwise"),
        # source: RwkvSelfAttention.extract_key_value: key/value/receptance inputs mixed with the shifted
        # sequence by time_mix_* ([1, 1, C], elementwise); rwkv_linear_attention_cpu: time_decay (-exp) and
        # time_first used elementwise in the WKV recurrence; key/value/receptance/output nn.Linear
        (r"rwkv\.blocks\.\d+\.attention\.(time_decay|time_first|time_mix_key|time_mix_value|time_mix_receptance)", "elementwise"),
        (r"rwkv\.blocks\.\d+\.attention\.(key|value|receptance|output)\.weight", "hidden"),
        # source: RwkvFeedForward.forward: time_mix_key / time_mix_receptance (elementwise) -> key -> relu^2
        # -> value, gated by sigmoid(receptance)
        (r"rwkv\.blocks\.\d+\.feed_forward\.(time_mix_key|time_mix_receptance)", "elementwise"),
        (r"rwkv\.blocks\.\d+\.feed_forward\.(key|value|receptance)\.weight", "hidden"),
        (r"rwkv\.ln_out\.(weight|bias)", "elementwise"),
        # source: RwkvForCausalLM.forward: head(hidden_states) -> logits
        (r"head\.weight", "head"),
    ],
    "FalconMambaForCausalLM": [
        # source: models/falcon_mamba/modeling_falcon_mamba.py, FalconMambaModel.forward: embeddings(input_ids)
        # (tied to lm_head)
        (r"backbone\.embeddings\.weight", "table"),
        (r"backbone\.layers\.\d+\.norm\.weight", "elementwise"),
        (r"backbone\.norm_f\.weight", "elementwise"),
        # source: FalconMambaMixer.slow_forward: in_proj -> conv1d (groups=intermediate_size: depthwise) ->
        # x_proj (-> dt, B, C) -> dt_proj(dt) (+ dt_proj.bias) -> scan with A = -exp(A_log), D skip -> out_proj
        (r"backbone\.layers\.\d+\.mixer\.(in_proj|x_proj|dt_proj|out_proj)\.weight", "hidden"),
        (r"backbone\.layers\.\d+\.mixer\.conv1d\.weight", "depthwise"),
        (r"backbone\.layers\.\d+\.mixer\.(conv1d|dt_proj)\.bias", "elementwise"),
        (r"backbone\.layers\.\d+\.mixer\.(A_log|D)", "elementwise"),
        # source: FalconMambaForCausalLM.forward: lm_head -> logits
        (r"lm_head\.weight", "head"),
    ],
    "BambaForCausalLM": [
        # source: models/bamba/modeling_bamba.py, BambaModel.forward: embed_tokens (nn.Embedding)
        (r"model\.embed_tokens\.weight", "table"),
        # source: BambaDecoderLayer.forward: input_layernorm -> mamba; pre_ff_layernorm -> feed_forward
        (r"model\.layers\.\d+\.(input_layernorm|pre_ff_layernorm)\.weight", "elementwise"),
        (r"model\.final_layernorm\.weight", "elementwise"),
        # source: BambaMixer.torch_forward: in_proj -> conv1d (groups=conv_dim: depthwise) -> SSM (dt_bias,
        # A_log, D) -> gated RMSNorm -> out_proj (both layers are mamba layers in the tiny config)
        (r"model\.layers\.\d+\.mamba\.(in_proj|out_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.mamba\.conv1d\.weight", "depthwise"),
        (r"model\.layers\.\d+\.mamba\.conv1d\.bias", "elementwise"),
        (r"model\.layers\.\d+\.mamba\.(dt_bias|A_log|D)", "elementwise"),
        (r"model\.layers\.\d+\.mamba\.norm\.weight", "elementwise"),
        # source: BambaMLP.forward: down_proj(act(gate_proj(x)) * up_proj(x))
        (r"model\.layers\.\d+\.feed_forward\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        # source: BambaForCausalLM.forward: lm_head -> logits
        (r"lm_head\.weight", "head"),
    ],
    "RecurrentGemmaForCausalLM": [
        # source: models/recurrent_gemma/modeling_recurrent_gemma.py, RecurrentGemmaModel.forward:
        # embed_tokens (tied to lm_head), scaled by sqrt(hidden_size)
        (r"model\.embed_tokens\.weight", "table"),
        # source: RecurrentGemmaDecoderLayer.forward: temporal_pre_norm / channel_pre_norm (RMSNorm)
        (r"model\.layers\.\d+\.(temporal_pre_norm|channel_pre_norm)\.weight", "elementwise"),
        (r"model\.final_norm\.weight", "elementwise"),
        # source: RecurrentGemmaRecurrentBlock.forward: linear_y -> act; linear_x -> conv_1d (groups=lru_width:
        # depthwise) -> rg_lru; x * y -> linear_out
        (r"model\.layers\.\d+\.temporal_block\.(linear_x|linear_y|linear_out)\.weight", "hidden"),
        (r"model\.layers\.\d+\.temporal_block\.(linear_x|linear_y|linear_out)\.bias", "elementwise"),
        (r"model\.layers\.\d+\.temporal_block\.conv_1d\.weight", "depthwise"),
        (r"model\.layers\.\d+\.temporal_block\.conv_1d\.bias", "elementwise"),
        # source: RecurrentGemmaRglru.forward: torch.baddbmm(gate_bias, x_heads, gate_weight) per head (block
        # diagonal [H, bw, bw] gates) -> sigmoid gates that scale the recurrence feeding linear_out;
        # recurrent_param enters softplus elementwise
        (r"model\.layers\.\d+\.temporal_block\.rg_lru\.(input_gate_weight|recurrent_gate_weight)", "hidden"),
        (r"model\.layers\.\d+\.temporal_block\.rg_lru\.(input_gate_bias|recurrent_gate_bias|recurrent_param)", "elementwise"),
        # source: RecurrentGemmaMlp.forward: down_proj(gelu(gate_proj(x)) * up_proj(x)) (with biases)
        (r"model\.layers\.\d+\.mlp_block\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.mlp_block\.(gate_proj|up_proj|down_proj)\.bias", "elementwise"),
        # source: RecurrentGemmaForCausalLM.forward: lm_head -> tanh soft-cap -> logits
        (r"lm_head\.weight", "head"),
    ],
    "Qwen3NextForCausalLM": [
        # source: models/qwen3_next/modeling_qwen3_next.py, Qwen3NextModel.forward: embed_tokens
        (r"model\.embed_tokens\.weight", "table"),
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", "elementwise"),
        (r"model\.norm\.weight", "elementwise"),
        # source: Qwen3NextGatedDeltaNet.forward: in_proj_qkvz and in_proj_ba nn.Linear; conv1d (groups=conv_dim:
        # depthwise, no bias); beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) (elementwise); gated
        # RMSNorm (norm.weight) -> out_proj (both tiny layers are linear_attention)
        (r"model\.layers\.\d+\.linear_attn\.(in_proj_qkvz|in_proj_ba|out_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.linear_attn\.conv1d\.weight", "depthwise"),
        (r"model\.layers\.\d+\.linear_attn\.(dt_bias|A_log)", "elementwise"),
        (r"model\.layers\.\d+\.linear_attn\.norm\.weight", "elementwise"),
        # source: Qwen3NextSparseMoeBlock.forward: gate (Qwen3NextTopKRouter, F.linear) -> routing weights;
        # experts (Qwen3NextExperts: F.linear(x, gate_up_proj[e]), F.linear(h, down_proj[e])); shared_expert
        # (MLP); sigmoid(shared_expert_gate(x)) * shared output
        (r"model\.layers\.\d+\.mlp\.gate\.weight", "hidden"),
        (r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)", "hidden"),
        (r"model\.layers\.\d+\.mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.mlp\.shared_expert_gate\.weight", "hidden"),
        # source: Qwen3NextForCausalLM.forward: lm_head -> logits
        (r"lm_head\.weight", "head"),
    ],
    # ======================================================================================
    # Mixture of experts
    # ======================================================================================
    "SwitchTransformersForConditionalGeneration": [
        # source: models/switch_transformers/modeling_switch_transformers.py, SwitchTransformersStack.forward:
        # embed_tokens; shared / encoder / decoder embed_tokens are one tensor (tied to lm_head)
        (r"(shared|encoder\.embed_tokens|decoder\.embed_tokens)\.weight", "table"),
        # source: SwitchTransformersAttention.forward: q/k/v/o nn.Linear; relative_attention_bias nn.Embedding
        # indexed by relative-position buckets (first block of each stack)
        (r"(encoder|decoder)\.block\.\d+\.layer\.\d+\.(SelfAttention|EncDecAttention)\.(q|k|v|o)\.weight", "hidden"),
        (r"(encoder|decoder)\.block\.\d+\.layer\.\d+\.SelfAttention\.relative_attention_bias\.weight", "table"),
        # source: SwitchTransformersDenseActDense.forward: wi -> act -> wo (dense blocks and each expert)
        (r"(encoder|decoder)\.block\.\d+\.layer\.\d+\.mlp\.(wi|wo)\.weight", "hidden"),
        (r"(encoder|decoder)\.block\.\d+\.layer\.\d+\.mlp\.experts\.expert_\d+\.(wi|wo)\.weight", "hidden"),
        # source: SwitchTransformersTop1Router.forward: classifier nn.Linear -> softmax -> max prob scales the
        # chosen expert's output
        (r"(encoder|decoder)\.block\.\d+\.layer\.\d+\.mlp\.router\.classifier\.weight", "hidden"),
        (r"(encoder|decoder)\.block\.\d+\.layer\.\d+\.layer_norm\.weight", "elementwise"),
        (r"(encoder|decoder)\.final_layer_norm\.weight", "elementwise"),
        # source: SwitchTransformersForConditionalGeneration.forward: lm_head(sequence_output * d_model**-0.5)
        (r"lm_head\.weight", "head"),
    ],
    "PhimoeForCausalLM": [
        # source: models/phimoe/modeling_phimoe.py, PhimoeModel.forward: embed_tokens
        (r"model\.embed_tokens\.weight", "table"),
        # source: PhimoeAttention.forward: q/k/v/o_proj (no bias)
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        # source: PhimoeSparseMoeBlock.forward: router nn.Linear -> sparsemixer multipliers; PhimoeExperts.forward:
        # F.linear(x, gate_up_proj[e]) -> chunk -> act * up -> F.linear(h, down_proj[e])
        (r"model\.layers\.\d+\.mlp\.router\.weight", "hidden"),
        (r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)", "hidden"),
        # source: PhimoeDecoderLayer: nn.LayerNorm (weight and bias); PhimoeModel.norm
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.(weight|bias)", "elementwise"),
        (r"model\.norm\.(weight|bias)", "elementwise"),
        (r"lm_head\.weight", "head"),
    ],
    "Llama4ForCausalLM": [
        # source: models/llama4/modeling_llama4.py, Llama4TextModel.forward: embed_tokens
        (r"model\.embed_tokens\.weight", "table"),
        # source: Llama4TextAttention.forward: q/k/v/o_proj (qk L2 norm has no weight)
        (r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", "hidden"),
        # source: Llama4TextMoe.forward: router (Llama4Router, nn.Linear) -> sigmoid scores scale routed_in;
        # Llama4TextExperts.forward: bmm(x, gate_up_proj [E, H, 2I]) -> bmm(h, down_proj [E, I, H]);
        # shared_expert (Llama4TextMLP) added
        (r"model\.layers\.\d+\.feed_forward\.router\.weight", "hidden"),
        (r"model\.layers\.\d+\.feed_forward\.experts\.(gate_up_proj|down_proj)", "hidden"),
        (r"model\.layers\.\d+\.feed_forward\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", "elementwise"),
        (r"model\.norm\.weight", "elementwise"),
        (r"lm_head\.weight", "head"),
    ],
    "DeepseekV2ForCausalLM": [
        # source: models/deepseek_v2/modeling_deepseek_v2.py, DeepseekV2Model.forward: embed_tokens
        (r"model\.embed_tokens\.weight", "table"),
        # source: DeepseekV2Attention.forward (MLA): q_b_proj(q_a_layernorm(q_a_proj(x))); kv_a_proj_with_mqa
        # -> split (compressed kv, k_pe) -> kv_a_layernorm -> kv_b_proj; o_proj
        (r"model\.layers\.\d+\.self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.self_attn\.(q_a_layernorm|kv_a_layernorm)\.weight", "elementwise"),
        # source: DeepseekV2Moe.forward: gate (DeepseekV2TopkRouter: F.linear -> softmax -> topk weights);
        # DeepseekV2Experts.forward: F.linear(x, gate_up_proj[e]), F.linear(h, down_proj[e]); shared_experts
        (r"model\.layers\.\d+\.mlp\.gate\.weight", "hidden"),
        (r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)", "hidden"),
        (r"model\.layers\.\d+\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight", "hidden"),
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", "elementwise"),
        (r"model\.norm\.weight", "elementwise"),
        (r"lm_head\.weight", "head"),
    ],
    "JetMoeForCausalLM": [
        # source: models/jetmoe/modeling_jetmoe.py, JetMoeModel.forward: embed_tokens (tied to lm_head)
        (r"model\.embed_tokens\.weight", "table"),
        # source: JetMoeMoA.map / reduce (mixture of attention heads): router (JetMoeTopKGating.layer) ->
        # top-k gates; input_linear (per-expert query projection, JetMoeParallelExperts: F.linear(x, w[e]))
        # and output_linear (per-expert output projection); bias added to the merged output; kv_proj shared
        (r"model\.layers\.\d+\.self_attention\.kv_proj\.weight", "hidden"),
        (r"model\.layers\.\d+\.self_attention\.experts\.(input_linear|output_linear)\.weight", "hidden"),
        (r"model\.layers\.\d+\.self_attention\.experts\.router\.layer\.weight", "hidden"),
        (r"model\.layers\.\d+\.self_attention\.experts\.bias", "elementwise"),
        # source: JetMoeMoE.forward: router -> input_linear [E, 2I, H] -> chunk -> act * up -> output_linear
        # [E, H, I] -> * gates -> + bias
        (r"model\.layers\.\d+\.mlp\.(input_linear|output_linear)\.weight", "hidden"),
        (r"model\.layers\.\d+\.mlp\.router\.layer\.weight", "hidden"),
        (r"model\.layers\.\d+\.mlp\.bias", "elementwise"),
        (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", "elementwise"),
        (r"model\.norm\.weight", "elementwise"),
        (r"lm_head\.weight", "head"),
    ],
    # ======================================================================================
    # Multimodal / contrastive
    # ======================================================================================
    "CLIPModel": [
        # source: models/clip/modeling_clip.py, CLIPModel.forward: logits = text_embeds @ image_embeds.T *
        # logit_scale.exp() (0-D)
        (r"logit_scale", "elementwise"),
        # source: CLIPTextEmbeddings.forward: token_embedding + position_embedding (nn.Embedding)
        (r"text_model\.embeddings\.(token_embedding|position_embedding)\.weight", "table"),
        # source: CLIPVisionEmbeddings.forward: patch_embedding Conv2d on pixel_values; cat((class_embedding,
        # patches)) + position_embedding(position_ids) (nn.Embedding)
        (r"vision_model\.embeddings\.class_embedding", "table"),
        (r"vision_model\.embeddings\.position_embedding\.weight", "table"),
        (r"vision_model\.embeddings\.patch_embedding\.weight", "hidden"),
        (r"vision_model\.pre_layrnorm\.(weight|bias)", "elementwise"),
        # source: CLIPAttention.forward (q/k/v/out_proj), CLIPMLP.forward (fc1, fc2), both towers
        (r"(text|vision)_model\.encoder\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|out_proj)\.weight", "hidden"),
        (r"(text|vision)_model\.encoder\.layers\.\d+\.mlp\.(fc1|fc2)\.weight", "hidden"),
        (r"(text|vision)_model\.encoder\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.(fc1|fc2))\.bias", "elementwise"),
        (r"(text|vision)_model\.encoder\.layers\.\d+\.(layer_norm1|layer_norm2)\.(weight|bias)", "elementwise"),
        (r"text_model\.final_layer_norm\.(weight|bias)", "elementwise"),
        (r"vision_model\.post_layernorm\.(weight|bias)", "elementwise"),
        # source: CLIPModel.forward: image_embeds = visual_projection(pooled), text_embeds =
        # text_projection(pooled): the contrastive embeddings (then normalised and multiplied together)
        (r"(visual_projection|text_projection)\.weight", "head"),
    ],
    "SiglipModel": [
        # source: models/siglip/modeling_siglip.py, SiglipModel.forward: logits_per_text * logit_scale.exp()
        # + logit_bias ([1] each)
        (r"logit_(scale|bias)", "elementwise"),
        # source: SiglipTextEmbeddings.forward: token_embedding + position_embedding (nn.Embedding)
        (r"text_model\.embeddings\.(token_embedding|position_embedding)\.weight", "table"),
        # source: SiglipVisionEmbeddings.forward: patch_embedding Conv2d on pixel_values +
        # position_embedding(position_ids)
        (r"vision_model\.embeddings\.patch_embedding\.weight", "hidden"),
        (r"vision_model\.embeddings\.patch_embedding\.bias", "elementwise"),
        (r"vision_model\.embeddings\.position_embedding\.weight", "table"),
        # source: SiglipAttention.forward (q/k/v/out_proj), SiglipMLP.forward (fc1, fc2), both towers
        (r"(text|vision)_model\.encoder\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|out_proj)\.weight", "hidden"),
        (r"(text|vision)_model\.encoder\.layers\.\d+\.mlp\.(fc1|fc2)\.weight", "hidden"),
        (r"(text|vision)_model\.encoder\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.(fc1|fc2))\.bias", "elementwise"),
        (r"(text|vision)_model\.encoder\.layers\.\d+\.(layer_norm1|layer_norm2)\.(weight|bias)", "elementwise"),
        (r"text_model\.final_layer_norm\.(weight|bias)", "elementwise"),
        (r"vision_model\.post_layernorm\.(weight|bias)", "elementwise"),
        # source: SiglipTextTransformer.forward: pooled = head(last_hidden_state[:, -1]) -> text_embeds
        (r"text_model\.head\.weight", "head"),
        (r"text_model\.head\.bias", "elementwise"),
        # source: SiglipMultiheadAttentionPoolingHead.forward: probe (the query input of the pooling
        # attention) -> nn.MultiheadAttention(probe, x, x) -> residual + mlp(layernorm(.)) -> [:, 0] =
        # image_embeds. in_proj_weight (packed q/k/v, split before the matmul) and out_proj feed the MLP.
        # mlp.fc2 writes image_embeds with no matmul after it, but as one term of a residual sum
        # (residual + fc2(...)) whose other writer, out_proj, also feeds fc1: a residual stream's last
        # write, as a base model's last down_proj is, so hidden (docs/roles.md, "heads and residual streams")
        (r"vision_model\.head\.probe", "table"),
        (r"vision_model\.head\.attention\.in_proj_weight", "hidden"),
        (r"vision_model\.head\.attention\.out_proj\.weight", "hidden"),
        (r"vision_model\.head\.attention\.(in_proj_bias|out_proj\.bias)", "elementwise"),
        (r"vision_model\.head\.layernorm\.(weight|bias)", "elementwise"),
        (r"vision_model\.head\.mlp\.fc1\.weight", "hidden"),
        (r"vision_model\.head\.mlp\.fc2\.weight", "hidden"),
        (r"vision_model\.head\.mlp\.(fc1|fc2)\.bias", "elementwise"),
    ],
    "PerceiverForMaskedLM": [
        # source: models/perceiver/modeling_perceiver.py, PerceiverTextPreprocessor.forward: embeddings(inputs)
        # + position_embeddings(positions) (nn.Embedding). The same embeddings.weight is also the output
        # matrix of PerceiverEmbeddingDecoder.forward (matmul(h, embedding_layer.weight.T) -> logits) under
        # this one name: primary category `table` (an nn.Embedding read by index), see the module docstring
        (r"perceiver\.input_preprocessor\.embeddings\.weight", "table"),
        (r"perceiver\.input_preprocessor\.position_embeddings\.weight", "table"),
        # source: PerceiverEmbeddings.forward: latents.expand(batch) -> the query input of the encoder's
        # cross-attention (layernorm1 -> query nn.Linear) and its residual
        (r"perceiver\.embeddings\.latents", "table"),
        # source: PerceiverSelfAttention.forward (layernorm1/layernorm2, query/key/value), PerceiverSelfOutput
        # (dense), PerceiverLayer.forward (layernorm -> PerceiverMLP dense1 -> act -> dense2): encoder
        # cross-attention, self-attends and the decoder's cross-attention, all feeding the final logits matmul
        (r"perceiver\.(encoder\.cross_attention|encoder\.self_attends\.\d+|decoder\.decoding_cross_attention)\.attention\.self\.(query|key|value)\.weight", "hidden"),
        (r"perceiver\.(encoder\.cross_attention|encoder\.self_attends\.\d+|decoder\.decoding_cross_attention)\.attention\.output\.dense\.weight", "hidden"),
        (r"perceiver\.(encoder\.cross_attention|encoder\.self_attends\.\d+|decoder\.decoding_cross_attention)\.mlp\.(dense1|dense2)\.weight", "hidden"),
        (r"perceiver\.(encoder\.cross_attention|encoder\.self_attends\.\d+|decoder\.decoding_cross_attention)\.(attention\.self\.(query|key|value)|attention\.output\.dense|mlp\.(dense1|dense2))\.bias", "elementwise"),
        (r"perceiver\.(encoder\.cross_attention|encoder\.self_attends\.\d+|decoder\.decoding_cross_attention)\.attention\.self\.(layernorm1|layernorm2)\.(weight|bias)", "elementwise"),
        (r"perceiver\.(encoder\.cross_attention|encoder\.self_attends\.\d+|decoder\.decoding_cross_attention)\.layernorm\.(weight|bias)", "elementwise"),
        # source: PerceiverBasicDecoder.decoder_query: trainable position encodings (PerceiverTrainablePositionEncoding)
        # are the decoder's query input (layernorm1 -> query nn.Linear); final_project=False
        (r"perceiver\.decoder\.output_position_encodings\.position_embeddings", "table"),
        # source: PerceiverEmbeddingDecoder.forward: output + bias
        (r"embedding_decoder\.bias", "elementwise"),
    ],
}

BLOCKS: dict[str, list[tuple[str, tuple[int, int, int]]]] = {
    # model class -> [(regex of a param, (number of blocks, out, in) of the matrices the forward multiplies
    # by, per block)]

    # source: Wav2Vec2PositionalConvEmbedding: Conv1d(64, 64, kernel 128, groups=16) on the weight-norm
    # direction v [64, 4, 128]: 16 groups of out 64/16=4, in 4 channels * 128 taps = 512
    "Wav2Vec2ForCTC": [
        (r"wav2vec2\.encoder\.pos_conv_embed\.conv\.parametrizations\.weight\.original1", (16, 4, 512)),
    ],
    "HubertForSequenceClassification": [
        (r"hubert\.encoder\.pos_conv_embed\.conv\.parametrizations\.weight\.original1", (16, 4, 512)),
    ],
    # source: RecurrentGemmaRglru.forward: torch.baddbmm(b, x [H, BT, bw], W [H, bw, bw]): x @ W[h]
    # contracts dim 1; 4 heads of 16 x 16
    "RecurrentGemmaForCausalLM": [
        (r"model\.layers\.\d+\.temporal_block\.rg_lru\.(input_gate_weight|recurrent_gate_weight)", (4, 16, 16)),
    ],
    # source: Qwen3NextExperts.forward: F.linear(x, gate_up_proj[e]) with gate_up_proj [E, 2I, H] =
    # [4, 64, 64]; F.linear(h, down_proj[e]) with down_proj [E, H, I] = [4, 64, 32]
    "Qwen3NextForCausalLM": [
        (r"model\.layers\.\d+\.mlp\.experts\.gate_up_proj", (4, 64, 64)),
        (r"model\.layers\.\d+\.mlp\.experts\.down_proj", (4, 64, 32)),
    ],
    # source: PhimoeExperts.forward: F.linear with gate_up_proj [4, 256, 64] and down_proj [4, 64, 128]
    "PhimoeForCausalLM": [
        (r"model\.layers\.\d+\.mlp\.experts\.gate_up_proj", (4, 256, 64)),
        (r"model\.layers\.\d+\.mlp\.experts\.down_proj", (4, 64, 128)),
    ],
    # source: Llama4TextExperts.forward: torch.bmm(x, gate_up_proj) with gate_up_proj [E, H, 2I] =
    # [4, 64, 256] (contracts dim 1: out 256, in 64); torch.bmm(h, down_proj) with [E, I, H] = [4, 128, 64]
    # (out 64, in 128)
    "Llama4ForCausalLM": [
        (r"model\.layers\.\d+\.feed_forward\.experts\.gate_up_proj", (4, 256, 64)),
        (r"model\.layers\.\d+\.feed_forward\.experts\.down_proj", (4, 64, 128)),
    ],
    # source: DeepseekV2Experts.forward: F.linear with gate_up_proj [4, 64, 64] and down_proj [4, 64, 32]
    "DeepseekV2ForCausalLM": [
        (r"model\.layers\.\d+\.mlp\.experts\.gate_up_proj", (4, 64, 64)),
        (r"model\.layers\.\d+\.mlp\.experts\.down_proj", (4, 64, 32)),
    ],
    # source: JetMoeParallelExperts.forward: F.linear(input_list[i], weight[i]) with weight [E, out, in]
    "JetMoeForCausalLM": [
        (r"model\.layers\.\d+\.mlp\.input_linear\.weight", (4, 256, 64)),
        (r"model\.layers\.\d+\.mlp\.output_linear\.weight", (4, 64, 128)),
        (r"model\.layers\.\d+\.self_attention\.experts\.input_linear\.weight", (4, 32, 64)),
        (r"model\.layers\.\d+\.self_attention\.experts\.output_linear\.weight", (4, 64, 32)),
    ],
    # source: SiglipMultiheadAttentionPoolingHead -> nn.MultiheadAttention(probe, x, x):
    # F._in_projection_packed splits in_proj_weight [3E, E] before the matmuls (query differs from key
    # (probe vs x), so w_q = w[:E] and w_kv = w[E:]): the q, k and v matrices, 3 x [64 x 64]
    "SiglipModel": [
        (r"vision_model\.head\.attention\.in_proj_weight", (3, 64, 64)),
    ],
}
