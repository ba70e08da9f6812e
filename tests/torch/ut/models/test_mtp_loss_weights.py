"""MTP loss weight per family: each family's ``MTP_LOSS_WEIGHT`` (its Megatron-Bridge recipe) is what its
builders, readers and recipes use (GLM-4.7-Flash 0.3, Qwen3.5 0.1).
"""

from __future__ import annotations


def test_mtp_loss_weight_is_each_familys_reference_value():
    from hyper_parallel.models.glm_image_moe_v2 import model as glm
    from hyper_parallel.models.glm_image_moe_v2.config_registry import glm_image_moe_debug, glm_image_moe_mtp_debug
    from hyper_parallel.models.qwen3_5_moe_v2 import model as qwen_moe
    from hyper_parallel.models.qwen3_5_v2 import model as qwen
    from hyper_parallel.models.qwen3_5_v2.config_registry import qwen3_5_debug, qwen3_5_mtp_debug
    from hyper_parallel.models.qwen3_vl_moe_v2 import model as vl
    from hyper_parallel.models.qwen3_vl_moe_v2.config_registry import qwen3_5_moe_vl_mtp_debug

    assert glm.MTP_LOSS_WEIGHT == 0.3  # Megatron-Bridge glm47_flash_bridge.py
    assert qwen.MTP_LOSS_WEIGHT == qwen_moe.MTP_LOSS_WEIGHT == vl.MTP_LOSS_WEIGHT == 0.1  # qwen35_common.py
    # every way a family's MTP block is made: the builder, the "turn it on" helper, the HF reader, the recipe
    assert glm_image_moe_mtp_debug().model.mtp.loss_weight == 0.3
    assert glm.glm_with_mtp(glm_image_moe_debug().model).mtp.loss_weight == 0.3
    read = glm.nextn_reader(lambda hf: glm_image_moe_debug().model)
    assert read({"num_nextn_predict_layers": 1}).mtp.loss_weight == 0.3
    assert qwen3_5_mtp_debug().model.mtp.loss_weight == 0.1
    assert qwen.qwen3_5_with_mtp(qwen3_5_debug().model).mtp.loss_weight == 0.1
    assert qwen3_5_moe_vl_mtp_debug().model.mtp.loss_weight == 0.1
