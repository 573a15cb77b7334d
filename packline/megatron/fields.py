"""Megatron-Bridge's config dataclasses, as far as overrides reach into them: for its
``ConfigContainer`` and every config dataclass reachable from it (with packline's
``section_classes`` in place of the unions Bridge declares), the dataclass bases, the
plain fields and the fields that hold a nested config dataclass. Only fields are listed,
no values: ``packline.megatron.overrides`` checks every ``megatron.extra_overrides`` key
against it without importing Bridge.

Generated from the source of the pinned wheels
(megatron-bridge==0.6.2, megatron-core==0.19.2), and of packline's dataset for Bridge
(packline/megatron/dataset.py), by tests/unit/test_megatron_overrides.py,
which regenerates it and asserts it is equal. Do not edit: rewrite it with
``PACKLINE_UPDATE_GOLDEN=1`` and

    .venv/bin/python -m pytest tests/unit/test_megatron_overrides.py -k bridge_fields
"""

# ruff: noqa: E501 (generated: a qualified class name per line)

PINNED = ("megatron-bridge==0.6.2", "megatron-core==0.19.2")
CONTAINER = "megatron.bridge.training.config.ConfigContainer"

#: qualified class name → (dataclass bases, its plain fields space-separated,
#: {field: the config dataclass it holds})
CLASSES: dict[str, tuple[tuple[str, ...], str, dict[str, str]]] = {
    "megatron.bridge.data.base.DataloaderConfig": (
        (),
        (
            "dataloader_type num_workers data_sharding pin_memory drop_last"
            " persistent_workers trust_remote_code dataloader_save dataloader_load"
        ),
        {},
    ),
    "megatron.bridge.data.base.DatasetProvider": (
        ("megatron.bridge.data.base.DataloaderConfig",),
        "",
        {},
    ),
    "megatron.bridge.data.builders.energon.EnergonDatasetConfig": (
        ("megatron.bridge.data.base.DataloaderConfig",),
        (
            "path seq_length micro_batch_size task_encoder dataloader_type do_validation"
            " do_test num_val_workers shuffle_buffer_size max_samples_per_sequence"
            " packing_buffer_size dataset_kwargs enable_in_batch_packing"
            " defer_in_batch_packing_to_step pad_to_max_length pad_to_multiple_of"
            " in_batch_packing_pad_to_multiple_of"
        ),
        {},
    ),
    "megatron.bridge.data.builders.energon.QwenVLEnergonTaskEncoderConfig": (
        (),
        (
            "hf_processor_path temporal_patch_size spatial_merge_size patch_size min_pixels"
            " max_pixels max_num_images max_num_frames max_visual_tokens trust_remote_code"
        ),
        {},
    ),
    "megatron.bridge.models.gpt_provider.GPTModelProvider": (
        ("megatron.bridge.models.transformer_config.TransformerConfig",),
        (
            "fp16_lm_cross_entropy parallel_output share_embeddings_and_output_weights"
            " make_vocab_size_divisible_by position_embedding_type rotary_base rotary_percent"
            " rope_scaling rope_scaling_factor rotary_scaling_factor"
            " seq_len_interpolation_factor yarn_rotary_scaling_factor"
            " yarn_original_max_position_embeddings yarn_beta_fast yarn_beta_slow yarn_mscale"
            " yarn_mscale_all_dim yarn_correction_range_round_to_int seq_length"
            " attention_softmax_in_fp32 deallocate_pipeline_outputs"
            " scatter_embedding_sequence_parallel tp_only_amax_red tp_comm_overlap_cfg"
            " use_transformer_engine_full_layer_spec use_transformer_engine_op_fuser"
            " dense_grouped_gemm transformer_layer_spec hf_model_id hf_model_revision"
            " vocab_size should_pad_vocab num_moe_experts moe_grouped_gemm qk_layernorm fp8"
            " normalization mtp_enabled init_model_with_meta_device use_te_rng_tracker"
            " virtual_pipeline_model_parallel_size account_for_embedding_in_pipeline_split"
            " account_for_loss_in_pipeline_split masked_softmax_fusion"
            " cross_entropy_loss_fusion gradient_accumulation_fusion restore_modelopt_state"
            " use_arbitrary_attention_mask _pg_collection"
        ),
        {},
    ),
    "megatron.bridge.models.qwen_vl.qwen3_vl_provider.DistTrainConfig": (
        (),
        (
            "use_dist_train vision_to_llm_dp_ratio vision_world_size language_world_size"
            " vision_tensor_model_parallel_size vision_pipeline_model_parallel_size"
            " vision_context_parallel_size vision_expert_tensor_parallel_size"
            " vision_expert_model_parallel_size"
        ),
        {},
    ),
    "megatron.bridge.models.qwen_vl.qwen3_vl_provider.Qwen3VLMoEModelProvider": (
        ("megatron.bridge.models.gpt_provider.GPTModelProvider",),
        (
            "vision_config hf_text_config pretrained_model_name image_token_id video_token_id"
            " vision_start_token_id vision_end_token_id bos_token_id eos_token_id head_dim"
            " qk_layernorm attention_softmax_in_fp32 attention_dropout position_embedding_type"
            " apply_rotary_pos_emb_in_fp32 deepstack_visual_indexes mrope_section rotary_base"
            " spatial_merge_size temporal_patch_size patch_size"
            " scatter_embedding_sequence_parallel moe_router_pre_softmax moe_router_dtype"
            " moe_router_score_function moe_router_bias_update_rate moe_permute_fusion"
            " moe_token_dispatcher_type mlp_only_layers decoder_sparse_step"
            " freeze_language_model freeze_vision_model freeze_vision_projection"
            " language_max_sequence_length persist_layer_norm bias_activation_fusion"
            " bias_dropout_fusion masked_softmax_fusion deallocate_pipeline_outputs"
            " distribute_saved_activations cp_comm_type use_hf_vision_model vision_dp_when_cp"
            " add_encoder add_decoder vision_cuda_graph_impl vision_cuda_graph_scope"
            " max_vision_cuda_graph_seq_length"
        ),
        {
            "dist_train": "megatron.bridge.models.qwen_vl.qwen3_vl_provider.DistTrainConfig",
        },
    ),
    "megatron.bridge.models.qwen_vl.qwen3_vl_provider.Qwen3VLModelProvider": (
        ("megatron.bridge.models.gpt_provider.GPTModelProvider",),
        (
            "language_max_sequence_length patch_size temporal_patch_size in_channels"
            " spatial_merge_size num_position_embeddings out_hidden_size"
            " apply_rotary_pos_emb_in_fp32 deepstack_visual_indexes fp16_lm_cross_entropy"
            " rotary_percent apply_rope_fusion vision_config hf_text_config image_token_id"
            " video_token_id vision_start_token_id vision_end_token_id bos_token_id"
            " eos_token_id position_embedding_type attention_dropout attention_softmax_in_fp32"
            " mrope_section rotary_base scatter_embedding_sequence_parallel"
            " freeze_language_model freeze_vision_model freeze_vision_projection"
            " sequence_parallel qk_layernorm bias_activation_fusion use_hf_vision_model"
            " vision_dp_when_cp add_encoder add_decoder vision_cuda_graph_impl"
            " vision_cuda_graph_scope max_vision_cuda_graph_seq_length"
        ),
        {
            "dist_train": "megatron.bridge.models.qwen_vl.qwen3_vl_provider.DistTrainConfig",
        },
    ),
    "megatron.bridge.models.transformer_config.TransformerConfig": (
        ("megatron.core.transformer.transformer_config.TransformerConfig",),
        "",
        {},
    ),
    "megatron.bridge.peft.base.PEFT": (
        (),
        "params_to_save",
        {},
    ),
    "megatron.bridge.peft.lora.LoRA": (
        (
            "megatron.bridge.peft.base.PEFT",
            "megatron.bridge.peft.module_matcher.ModuleMatcher",
        ),
        (
            "target_modules dim alpha dropout dropout_position"
            " sequence_parallel_input_regather lora_A_init_method lora_B_init_method"
            " a2a_experimental lora_dtype normalize_moe_lora share_expert_adapters"
            " experts_shared_outer_loras"
        ),
        {},
    ),
    "megatron.bridge.peft.module_matcher.ModuleMatcher": (
        (),
        (
            "target_modules exclude_modules canonical_mapping _pattern_to_alias"
            " _alias_to_pattern _alias_matches"
        ),
        {},
    ),
    "megatron.bridge.training.comm_overlap.CommOverlapConfig": (
        (),
        (
            "tp_comm_overlap tp_comm_bootstrap_backend overlap_p2p_comm batch_p2p_comm"
            " overlap_grad_reduce overlap_param_gather"
            " overlap_param_gather_with_optimizer_step align_param_gather bucket_size"
            " defer_embedding_wgrad_compute wgrad_deferral_limit data_parallel_size"
            " overlap_moe_expert_parallel_comm delay_wgrad_compute"
        ),
        {
            "tp_comm_overlap_cfg": "megatron.bridge.training.comm_overlap.TransformerLayerTPOverlapCfg",
        },
    ),
    "megatron.bridge.training.comm_overlap.TransformerLayerTPOverlapCfg": (
        (),
        (
            "qkv_dgrad qkv_wgrad fc1_dgrad fc1_wgrad qkv_fprop proj_dgrad fc1_fprop fc2_dgrad"
            " proj_fprop fc2_fprop"
        ),
        {},
    ),
    "megatron.bridge.training.config.CheckpointConfig": (
        ("megatron.training.config.training_config.CheckpointConfig",),
        (
            "pretrained_checkpoint storage_writers_per_rank use_persistent_ckpt_worker"
            " async_strategy async_write_results_mp_mode strict_fsdp_dtensor_load"
            " custom_manager_class dist_ckpt_workers also_save_hf_checkpoint hf_source_path"
            " hf_trust_remote_code hf_distributed_save hf_save_every_n_ranks"
        ),
        {},
    ),
    "megatron.bridge.training.config.ConfigContainer": (
        (),
        (
            "env_vars model optimizer_config_override_provider dataset peft mixed_precision"
            " _checkpoint_load_required"
        ),
        {
            "rng": "megatron.training.config.common_config.RNGConfig",
            "rerun_state_machine": "megatron.bridge.training.config.RerunStateMachineConfig",
            "train": "megatron.bridge.training.config.TrainingConfig",
            "optimizer": "megatron.bridge.training.config.OptimizerConfig",
            "ddp": "megatron.bridge.training.config.DistributedDataParallelConfig",
            "validation": "megatron.training.config.training_config.ValidationConfig",
            "scheduler": "megatron.bridge.training.config.SchedulerConfig",
            "logger": "megatron.bridge.training.config.LoggerConfig",
            "tokenizer": "megatron.bridge.training.tokenizers.config.TokenizerConfig",
            "checkpoint": "megatron.bridge.training.config.CheckpointConfig",
            "dist": "megatron.bridge.training.config.DistributedInitConfig",
            "ft": "megatron.bridge.training.config.FaultToleranceConfig",
            "straggler": "megatron.bridge.training.config.StragglerDetectionConfig",
            "nvrx_straggler": "megatron.bridge.training.config.NVRxStragglerDetectionConfig",
            "profiling": "megatron.bridge.training.config.ProfilingConfig",
            "comm_overlap": "megatron.bridge.training.comm_overlap.CommOverlapConfig",
            "tensor_inspect": "megatron.bridge.training.config.TensorInspectConfig",
            "inprocess_restart": "megatron.bridge.training.config.InProcessRestartConfig",
        },
    ),
    "megatron.bridge.training.config.DistributedDataParallelConfig": (
        (
            "megatron.core.distributed.distributed_data_parallel_config.DistributedDataParallelConfig",
        ),
        "param_name_patterns_for_fp32_local_accumulation",
        {},
    ),
    "megatron.bridge.training.config.DistributedInitConfig": (
        ("megatron.training.config.common_config.DistributedInitConfig",),
        (
            "external_gpu_device_mapping enable_megatron_core_experimental"
            " use_decentralized_pg eval_context_parallel_size"
        ),
        {},
    ),
    "megatron.bridge.training.config.FaultToleranceConfig": (
        (),
        (
            "enable_ft_package calc_ft_timeouts simulate_fault simulated_fault_type"
            " simulated_fault_rank simulated_fault_base_delay"
        ),
        {},
    ),
    "megatron.bridge.training.config.InProcessRestartConfig": (
        (),
        (
            "enabled max_iterations monitor_thread_interval monitor_process_interval"
            " progress_watchdog_interval heartbeat_interval soft_timeout hard_timeout"
            " heartbeat_timeout barrier_timeout completion_timeout last_call_wait"
            " termination_grace_time granularity active_world_size empty_cuda_cache"
            " max_rank_faults monitor_process_logdir"
        ),
        {},
    ),
    "megatron.bridge.training.config.LoggerConfig": (
        ("megatron.training.config.training_config.LoggerConfig",),
        (
            "skip_train_metrics_log timing_log_level mlflow_experiment mlflow_run_name"
            " mlflow_tracking_uri mlflow_tags mlflow_description mlflow_log_artifacts"
            " comet_project comet_experiment_name comet_workspace comet_api_key comet_tags"
            " logging_level"
        ),
        {},
    ),
    "megatron.bridge.training.config.NVRxStragglerDetectionConfig": (
        (),
        (
            "enabled report_time_interval calc_relative_gpu_perf calc_individual_gpu_perf"
            " num_gpu_perf_scores_to_print gpu_relative_perf_threshold"
            " gpu_individual_perf_threshold stop_if_detected enable_logging profiling_interval"
            " logger_name"
        ),
        {},
    ),
    "megatron.bridge.training.config.OptimizerConfig": (
        ("megatron.core.optimizer.optimizer_config.OptimizerConfig",),
        "",
        {},
    ),
    "megatron.bridge.training.config.ProfilingConfig": (
        ("megatron.training.config.common_config.ProfilingConfig",),
        "profile_ranks memory_snapshot_path",
        {},
    ),
    "megatron.bridge.training.config.RerunStateMachineConfig": (
        ("megatron.training.config.resilience_config.RerunStateMachineConfig",),
        "rerun_mode spiky_loss_factor",
        {},
    ),
    "megatron.bridge.training.config.SchedulerConfig": (
        ("megatron.training.config.training_config.SchedulerConfig",),
        "max_steps",
        {},
    ),
    "megatron.bridge.training.config.StragglerDetectionConfig": (
        ("megatron.training.config.resilience_config.StragglerDetectionConfig",),
        "enable_straggler_on_startup",
        {},
    ),
    "megatron.bridge.training.config.TensorInspectConfig": (
        (),
        (
            "enabled features feature_dirs allow_custom_feature_dirs log_dir"
            " init_training_step _feature_dirs_from_default"
        ),
        {},
    ),
    "megatron.bridge.training.config.TrainingConfig": (
        ("megatron.training.config.training_config.TrainingConfig",),
        (
            "num_epochs _train_iters_from_num_epochs check_optimizer_step_success"
            " skip_sync_grad_norm_across_mp eval_iters eval_interval skip_train"
        ),
        {},
    ),
    "megatron.bridge.training.tokenizers.config.TokenizerConfig": (
        ("megatron.training.config.training_config.TokenizerConfig",),
        (
            "make_vocab_size_divisible_by tensor_model_parallel_size rank"
            " use_tokenizer_vocab_size hf_tokenizer_kwargs sp_tokenizer_kwargs"
            " chat_template_path tokenizer_prompt_format image_tag_type force_system_message"
        ),
        {},
    ),
    "megatron.core.distributed.distributed_data_parallel_config.DistributedDataParallelConfig": (
        (),
        (
            "grad_reduce_in_fp32 overlap_grad_reduce overlap_param_gather align_param_gather"
            " use_distributed_optimizer num_distributed_optimizer_instances"
            " check_for_nan_in_grad check_for_large_grads bucket_size num_buckets"
            " pad_buckets_for_high_nccl_busbw reduce_scatter_with_fp32_accumulation"
            " param_name_patterns_for_fp32_local_accumulation average_in_collective"
            " fp8_param_gather fp4_param_gather reuse_grad_buf_for_mxfp8_param_ag"
            " use_megatron_fsdp use_custom_fsdp data_parallel_sharding_strategy"
            " gradient_reduce_div_fusion suggested_communication_unit_size"
            " keep_fp8_transpose_cache nccl_ub fsdp_double_buffer"
            " fsdp_db_use_persist_buf_on_alloc_fail fsdp_all_gather_in_start_param_sync"
            " outer_dp_sharding_strategy disable_symmetric_registration"
            " fsdp_manual_registration delay_wgrad_compute megatron_fsdp_main_params_dtype"
            " megatron_fsdp_main_grads_dtype megatron_fsdp_grad_comm_dtype"
            " megatron_fsdp_use_decoupled_grad megatron_fsdp_cuda_graph_mode"
            " megatron_fsdp_enable_fine_grained_param_gather"
            " megatron_fsdp_max_pool_double_buffer"
        ),
        {},
    ),
    "megatron.core.model_parallel_config.ModelParallelConfig": (
        (),
        (
            "tensor_model_parallel_size tensor_parallel_num_weight_shards"
            " gtp_weight_remat_size pipeline_model_parallel_comm_backend"
            " pipeline_model_parallel_size virtual_pipeline_model_parallel_size"
            " sequence_parallel context_parallel_size hierarchical_context_parallel_sizes"
            " max_seqlen_per_dp_cp_rank hybrid_context_parallel expert_model_parallel_size"
            " expert_tensor_parallel_size expert_tensor_parallel_num_weight_shards"
            " expert_gtp_weight_remat_size perform_initialization use_cpu_initialization fp16"
            " bf16 params_dtype timers finalize_model_grads_func grad_scale_func"
            " moe_grad_scale_func mtp_grad_scale_func no_sync_func grad_sync_func"
            " param_sync_func deterministic_mode enable_autocast autocast_dtype"
            " num_microbatches_with_partial_activation_checkpoints"
            " gradient_accumulation_fusion use_te_rng_tracker tp_comm_overlap"
            " tp_comm_bulk_wgrad tp_comm_bulk_dgrad tp_comm_overlap_ag tp_comm_overlap_rs"
            " tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_atomic_ag tp_comm_split_rs"
            " tp_comm_atomic_rs cross_entropy_loss_fusion cross_entropy_fusion_impl"
            " tp_comm_overlap_disable_qkv tp_comm_overlap_disable_fc1"
            " tp_comm_bootstrap_backend overlap_moe_expert_parallel_comm delay_wgrad_compute"
            " overlap_dispatch_backward_with_experts_wgrad"
            " ep_overlap_early_attn_memory_release pipeline_dtype variable_seq_lengths"
            " overlap_p2p_comm batch_p2p_comm batch_p2p_sync use_ring_exchange_p2p"
            " deallocate_pipeline_outputs defer_embedding_wgrad_compute wgrad_deferral_limit"
            " overlap_p2p_comm_warmup_flush microbatch_group_size_per_vp_stage mtp_standalone"
            " cpu_offloading cpu_offloading_num_layers _cpu_offloading_context"
            " cpu_offloading_activations cpu_offloading_weights"
            " cpu_offloading_double_buffering cpu_offloading_retain_pinned_cpu_buffers"
            " barrier_with_L1_time"
        ),
        {},
    ),
    "megatron.core.optimizer.optimizer_config.OptimizerConfig": (
        (),
        (
            "lr min_lr decoupled_lr decoupled_min_lr weight_decay apply_wd_to_qk_layernorm"
            " fp8_recipe fp16 bf16 reuse_grad_buf_for_mxfp8_param_ag params_dtype"
            " use_precision_aware_optimizer store_param_remainders main_grads_dtype"
            " main_params_dtype exp_avg_dtype exp_avg_sq_dtype optimizer loss_scale"
            " initial_loss_scale min_loss_scale loss_scale_window hysteresis adam_beta1"
            " adam_beta2 adam_eps decoupled_weight_decay sgd_momentum muon_momentum"
            " muon_split_qkv muon_nesterov muon_scale_mode muon_fp32_matmul_prec"
            " muon_coefficient_type muon_num_ns_steps muon_tp_mode muon_extra_scale_factor"
            " muon_scalar_optimizer lion_beta1 lion_beta2 soap_shampoo_beta"
            " soap_precondition_frequency soap_use_kl_shampoo adaptive_muon_moment2_method"
            " adaptive_muon_beta2 adaptive_muon_eps use_distributed_optimizer"
            " use_layer_wise_distributed_optimizer overlap_param_gather"
            " overlap_param_gather_with_optimizer_step optimizer_cpu_offload"
            " optimizer_offload_fraction use_torch_optimizer_for_cpu_offload"
            " overlap_cpu_optimizer_d2h_h2d pin_cpu_grads pin_cpu_params clip_grad"
            " grad_norm_skip_threshold log_num_zeros_in_grad barrier_with_L1_time timers"
            " config_logger_dir optimizer_cuda_graph"
        ),
        {},
    ),
    "megatron.core.transformer.transformer_config.TransformerConfig": (
        ("megatron.core.model_parallel_config.ModelParallelConfig",),
        (
            "num_layers mtp_num_layers mtp_loss_scaling_factor mtp_use_repeated_layer"
            " mtp_detach_heads mtp_hybrid_override_pattern num_layers_in_first_pipeline_stage"
            " num_layers_in_last_pipeline_stage pipeline_model_parallel_layout"
            " account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split"
            " hidden_size num_attention_heads attention_backend flash_attention_version"
            " softmax_scale softmax_type num_query_groups ffn_hidden_size kv_channels"
            " hidden_dropout attention_dropout fp32_residual_connection"
            " apply_residual_connection_post_layernorm layernorm_epsilon"
            " layernorm_zero_centered_gamma add_bias_linear add_qkv_bias gated_linear_unit"
            " activation_func activation_func_fp8_input_store glu_linear_offset"
            " activation_func_clamp_value num_moe_experts rotary_interleaved window_size"
            " window_attn_skip_freq normalization qk_layernorm qk_l2_norm qk_clip"
            " qk_clip_alpha qk_clip_threshold log_max_attention_logit attention_output_gate"
            " test_mode calculate_per_token_loss multi_latent_attention no_rope_freq"
            " experimental_attention_variant experimental_attention_variant_loss_scale_func"
            " dsa_indexer_n_heads dsa_indexer_head_dim dsa_indexer_topk dsa_indexer_topk_freq"
            " dsa_indexer_skip_topk_offset dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss"
            " dsa_kernel_backend dsa_indexer_rope_interleaved dsa_indexer_rotate_activation"
            " dsa_indexer_scoring_relu dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32"
            " linear_attention_freq linear_conv_kernel_dim linear_key_head_dim"
            " linear_value_head_dim linear_num_key_heads linear_num_value_heads init_method"
            " output_layer_init_method init_method_std embedding_init_method"
            " embedding_init_method_std init_model_with_meta_device use_mup mup_width_mult"
            " mup_base_hidden_size mup_embedding_mult mup_output_mult mup_base_head_dim"
            " mup_attn_scale_power apply_query_key_layer_scaling attention_softmax_in_fp32"
            " disable_bf16_reduced_precision_matmul bias_activation_fusion"
            " masked_softmax_fusion persist_layer_norm memory_efficient_layer_norm"
            " bias_dropout_fusion apply_rope_fusion use_fused_weighted_squared_relu"
            " fused_single_qkv_rope fused_residual_rmsnorm use_transformer_engine_op_fuser"
            " recompute_granularity recompute_method recompute_num_layers"
            " distribute_saved_activations recompute_modules fp8 fp8_recipe fp8_param"
            " fp8_quantizer_factory fp8_margin fp8_interval fp8_amax_history_len"
            " fp8_amax_compute_algo fp8_wgrad fp8_output_proj fp8_dot_product_attention"
            " fp8_multi_head_attention tp_only_amax_red first_last_layers_bf16"
            " num_layers_at_start_in_bf16 num_layers_at_end_in_bf16 use_kitchen"
            " use_kitchen_attention kitchen_attention_backend fp4 fp4_recipe fp4_param"
            " fp4_quantizer_factory high_priority_a2a_comm_stream"
            " moe_shared_expert_intermediate_size moe_shared_expert_gate"
            " moe_shared_expert_overlap use_grouped_gemm_for_shared_expert"
            " moe_shared_expert_glu_interleave_size moe_layer_freq moe_ffn_hidden_size"
            " moe_router_load_balancing_type moe_router_topk moe_enable_routing_replay"
            " moe_router_topk_limited_devices moe_router_padding_for_quantization"
            " moe_router_padding_for_fp8 moe_router_num_groups moe_router_group_topk"
            " moe_router_pre_softmax moe_router_topk_scaling_factor moe_router_score_function"
            " moe_router_dtype moe_router_enable_expert_bias moe_router_bias_update_rate"
            " moe_router_quantile_balancing_ema moe_router_force_load_balancing"
            " moe_router_force_biased use_grouped_gemm_for_dense_mlp moe_grouped_gemm"
            " moe_single_grouped_weight moe_single_grouped_bias moe_aux_loss_coeff"
            " moe_z_loss_coeff moe_input_jitter_eps moe_token_dropping"
            " moe_token_dispatcher_type moe_enable_deepep moe_flex_dispatcher_backend"
            " moe_permute_fusion_into_hybridep moe_hybridep_pad_uneven_dispatch_inputs"
            " moe_per_layer_logging moe_expert_capacity_factor"
            " moe_pad_expert_input_to_capacity moe_pad_experts_for_cuda_graph_inference"
            " moe_token_drop_policy moe_layer_recompute moe_permute_fusion moe_router_fusion"
            " moe_apply_probs_on_input moe_latent_size moe_flex_dispatcher_num_sms"
            " moe_deepep_num_sms moe_hybridep_num_sms moe_hybridep_num_blocks_permute"
            " moe_hybridep_num_blocks_unpermute moe_hybridep_num_sms_preprocessing"
            " moe_ncclep_static_shape moe_ncclep_zero_copy moe_mlp_glu_interleave_size"
            " moe_expert_rank_capacity_factor cp_comm_type enable_cuda_graph"
            " cuda_graph_use_single_mempool cuda_graph_retain_backward_graph"
            " cuda_graph_warmup_steps external_cuda_graph cuda_graph_impl cuda_graph_modules"
            " inference_cuda_graph_scope cuda_graph_scope clone_scatter_output_in_embedding"
            " disable_parameter_transpose_cache config_logger_dir flash_decode"
            " batch_invariant_mode use_te_activation_func use_te_rng_tracker"
            " inference_rng_tracker inference_sampling_seed symmetric_ar_type"
            " nccl_all_reduce_for_prefill use_inference_optimized_layers"
            " inference_fuse_tp_communication inference_disable_triton_nvls_kernels"
            " inference_grouped_gemm_backend inference_moe_disable_fused_quant_kernels"
            " inference_moe_token_dispatcher_type mrope_section is_hybrid_model"
            " mamba_state_dim mamba_head_dim mamba_num_groups mamba_num_heads"
            " mamba_training_ssm_states_dtype use_mamba_mem_eff_path mlp_chunks_for_prefill"
            " mlp_chunks_for_training heterogeneous_block_specs hetereogenous_dist_checkpoint"
            " quant_recipe transformer_impl fine_grained_activation_offloading offload_modules"
            " min_offloaded_tensor_size delay_offload_until_cuda_graph"
            " delta_offload_bytes_across_pp_ranks activation_offload_fraction moe_paged_stash"
            " moe_paged_stash_page_size moe_paged_stash_buffer_size_factor_cuda"
            " moe_paged_stash_buffer_size_factor_cpu"
            " fine_grained_offloading_max_inflight_offloads"
        ),
        {},
    ),
    "megatron.training.config.common_config.DistributedInitConfig": (
        (),
        (
            "distributed_backend distributed_timeout_minutes align_grad_reduce local_rank"
            " lazy_mpu_init use_megatron_fsdp use_torch_fsdp2 nccl_communicator_config_path"
            " use_tp_pp_dp_mapping use_gloo_process_groups use_sharp sharp_enabled_group"
            " high_priority_stream_groups distributed_timeout_seconds_after_init"
            " flight_recorder_dump_path flight_recorder_trace_buffer_size"
            " flight_recorder_dump_on_timeout flight_recorder_include_stack_trace"
            " flight_recorder_include_only_active flight_recorder_extra_dump_on_exec"
            " disable_jit_fuser"
        ),
        {},
    ),
    "megatron.training.config.common_config.ProfilingConfig": (
        (),
        (
            "use_nsys_profiler profile_step_start profile_step_end use_pytorch_profiler"
            " pytorch_profiler_collect_shapes pytorch_profiler_collect_callstack"
            " pytorch_profiler_collect_chakra profile_ranks record_memory_history"
            " memory_snapshot_path record_shapes nvtx_ranges"
        ),
        {},
    ),
    "megatron.training.config.common_config.RNGConfig": (
        (),
        "seed te_rng_tracker inference_rng_tracker data_parallel_random_init",
        {},
    ),
    "megatron.training.config.resilience_config.RerunStateMachineConfig": (
        (),
        (
            "error_injection_rate error_injection_type rerun_mode check_for_nan_in_loss"
            " check_for_spiky_loss"
        ),
        {},
    ),
    "megatron.training.config.resilience_config.StragglerDetectionConfig": (
        (),
        ("log_straggler straggler_ctrlr_port straggler_minmax_count disable_straggler_on_startup"),
        {},
    ),
    "megatron.training.config.training_config.CheckpointConfig": (
        (),
        (
            "save save_interval save_params_interval save_activations_interval"
            " save_tokens_per_expert_interval save_wgrads_interval save_dgrads_interval"
            " save_retain_interval most_recent_k save_optim save_rng load load_optim"
            " load_main_params_from_ckpt load_rng non_persistent_save_interval"
            " non_persistent_ckpt_type non_persistent_global_ckpt_dir"
            " non_persistent_local_ckpt_dir non_persistent_local_ckpt_algo finetune"
            " pretrained_checkpoint ckpt_step use_checkpoint_args"
            " use_mp_args_from_checkpoint_args use_tokenizer_model_from_checkpoint_args"
            " exit_on_missing_checkpoint ckpt_format auto_detect_ckpt_format"
            " ckpt_convert_format ckpt_convert_save ckpt_convert_update_legacy_dist_opt_format"
            " fully_parallel_save async_save async_strategy use_persistent_ckpt_worker"
            " async_ckpt_cpu_priority async_ckpt_io_priority async_ckpt_use_cpu_shm"
            " fully_parallel_load ckpt_fully_parallel_load_exchange_algo"
            " ckpt_fully_parallel_save_process_group ckpt_fully_parallel_load_process_group"
            " ckpt_assume_constant_structure ckpt_load_validate_sharding_integrity"
            " strict_fsdp_dtensor_load dist_ckpt_strictness dist_ckpt_save_pre_mcore_014"
            " dist_ckpt_optim_fully_reshardable distrib_optim_fully_reshardable_mem_efficient"
            " save_tokenizer_assets replication replication_jump replication_factor"
            " verify_integrity stream_ckpt_dequant"
        ),
        {},
    ),
    "megatron.training.config.training_config.LoggerConfig": (
        (),
        (
            "log_interval log_params_norm log_throughput log_throughput_to_tensorboard"
            " throughput_window_size log_progress timing_log_level timing_log_option"
            " tensorboard_dir tensorboard_log_interval tensorboard_queue_size"
            " log_timers_to_tensorboard log_loss_scale_to_tensorboard"
            " log_validation_ppl_to_tensorboard log_memory_to_tensorboard memory_keys"
            " log_memory_interval log_device_memory_used log_l2_norm_grad_to_tensorboard"
            " log_num_zeros_in_grad log_max_attention_logit log_runtime_to_tensorboard"
            " runtime_time_unit barrier_with_L1_time log_world_size_to_tensorboard"
            " wandb_project wandb_exp_name wandb_save_dir wandb_entity logging_level"
            " filter_warnings modules_to_filter set_level_for_all_loggers log_energy"
            " save_config_filepath moe_routing_trace_path moe_routing_trace_max_training_iters"
            " moe_routing_trace_capture_logits moe_routing_trace_capture_hidden_states"
            " moe_routing_trace_dump_weights"
        ),
        {},
    ),
    "megatron.training.config.training_config.SchedulerConfig": (
        (),
        (
            "lr_decay_style lr_wsd_decay_style lr_decay_iters lr_decay_samples"
            " lr_wsd_decay_iters lr_wsd_decay_samples lr_warmup_fraction lr_warmup_iters"
            " lr_warmup_samples lr_warmup_init lr_decay_steps lr_warmup_steps"
            " override_opt_param_scheduler use_checkpoint_opt_param_scheduler"
            " start_weight_decay end_weight_decay weight_decay_incr_style"
            " no_weight_decay_cond_type wd_incr_steps wsd_decay_steps"
        ),
        {},
    ),
    "megatron.training.config.training_config.TokenizerConfig": (
        (),
        (
            "vocab_size padded_vocab_size pad_vocab_size vocab_file merge_file"
            " vocab_extra_ids tokenizer_type tokenizer_model metadata_path special_tokens"
            " tiktoken_pattern tiktoken_num_special_tokens tokenizer_sentencepiece_legacy"
            " tokenizer_sentencepiece_ignore_extra_whitespaces tokenizer_hf_no_use_fast"
            " tokenizer_hf_no_include_special_tokens trust_remote_code null_tokenizer_eod_id"
            " null_tokenizer_pad_id chat_template"
        ),
        {},
    ),
    "megatron.training.config.training_config.TrainingConfig": (
        (),
        (
            "micro_batch_size global_batch_size rampup_batch_size step_batch_size_schedule"
            " decrease_batch_size_if_needed empty_unused_memory_level"
            " check_weight_hash_across_dp_replicas_interval gpu_sniff_test_interval"
            " train_sync_interval train_iters train_samples exit_interval"
            " exit_duration_in_mins exit_signal_handler exit_signal"
            " exit_signal_handler_for_dataloader exit_signal_handler_for_training manual_gc"
            " manual_gc_interval manual_gc_eval iterations_to_skip"
        ),
        {},
    ),
    "megatron.training.config.training_config.ValidationConfig": (
        (),
        (
            "eval_iters eval_interval start_eval_at_iter eval_global_batch_size"
            " eval_micro_batch_size skip_train test_mode full_validation"
            " multiple_validation_sets validation_set_names"
        ),
        {},
    ),
    "packline.megatron.dataset.PacklineEnergonDataset": (
        ("megatron.bridge.data.base.DatasetProvider",),
        (
            "path lengths_path seq_length task_encoder micro_batch_size dataloader_type"
            " do_validation num_val_workers shuffle_buffer_size max_samples_per_sequence"
            " packing_buffer_size dataset_kwargs pad_to_max_length"
            " in_batch_packing_pad_to_multiple_of algorithm max_carry_rounds seed balance"
        ),
        {},
    ),
}
