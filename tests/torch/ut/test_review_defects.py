"""Defects found in review (issue 36), one section per item; each test failed on the code before its fix.

1. SFT masks at a multi-byte character: every token whose offsets overlap an assistant span trains,
   exactly as transformers' ``return_assistant_tokens_mask`` (the oracle), marked and derived spans alike.
2. MTP loss weight per family: each family's ``MTP_LOSS_WEIGHT`` (its Megatron-Bridge recipe) is what its
   builders, readers and recipes use (GLM-4.7-Flash 0.3, Qwen3.5 0.1).
3. The MTP layer's router aux loss is not scaled by the MTP loss weight: it adds ``coef x`` its Switch loss
   (transformers' ``load_balancing_loss_func`` is the oracle), whatever ``mtp.loss_weight`` is.
4. Expert parallel: the experts' output is not an autograd view (FSDP2 warned "returned a view tensor" for
   the experts' own FSDP unit); the launch check is in tests/torch/st/test_trainer_layouts.py.
6. Intra-op threads: a plain run picks a thread count per local rank (OMP_NUM_THREADS kept when set), logs it
   and restores the caller's count.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hyper_parallel.data.chat import check_conversation, encode_chat
from hyper_parallel.data.tokenizer import HuggingFaceTokenizer
from tests.torch.ut.test_chat_masks import FAMILIES, make_folder

# -- 1. SFT masks at a multi-byte character --------------------------------------------------------------

USER = "{% if m['role'] == 'user' %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n"
PROMPT = "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
# the issue's minimal template: the generation block holds the reply only, <|im_end|> follows it
ISSUE_TEMPLATE = (
    "{% for m in messages %}" + USER + "{% else %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}{% endgeneration %}<|im_end|>\n{% endif %}" + PROMPT
)


def _template(marked: bool, *, end_token: bool) -> str:
    """An assistant turn ``<|im_start|>assistant\\n`` + reply (+ ``<|im_end|>``) + ``\\n``; ``marked`` wraps
    exactly the span the derived path finds (the reply and the end token after it) in a generation block."""
    end = "<|im_end|>" if end_token else ""
    body = "{{ m['content'] }}" + end
    if marked:
        body = "{% generation %}" + body + "{% endgeneration %}"
    # the newline as an expression: trim_blocks (transformers' jinja setting) eats one right after a block tag
    turn = "{% else %}<|im_start|>assistant\n" + body + "{{ '\\n' }}{% endif %}"
    return "{% for m in messages %}" + USER + turn + PROMPT


def _chat(reply: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": reply}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Byte-level BPEs with no merge for the CJK / accented characters below (their bytes are separate tokens)."""
    root = tmp_path_factory.mktemp("defect_tok")
    templates = {"issue": ISSUE_TEMPLATE}
    for end_token in (True, False):
        for marked in (True, False):
            templates[f"{'marked' if marked else 'derived'}_{'end' if end_token else 'noend'}"] = _template(
                marked, end_token=end_token
            )
    return {name: make_folder(root / name, t, *FAMILIES["qwen3_5"]) for name, t in templates.items()}


def _oracle(folder: Path, chat: list[dict[str, str]]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    out = hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"]), list(out.encodings[0].offsets)


def _ours(folder: Path, chat: list[dict[str, str]]):
    tok = HuggingFaceTokenizer.from_folder(folder)
    messages, _ = check_conversation(chat)
    return tok, encode_chat(tok, messages)


def _byte_tokens(offsets: list[tuple[int, int]], text: str, char: str) -> list[int]:
    """Tokens that hold (a byte of) the last occurrence of ``char`` (several share its offsets)."""
    at = text.rindex(char)
    return [t for t, (a, b) in enumerate(offsets) if a <= at < b]


def test_issue_case_reply_ending_in_a_multibyte_character(folders):
    """``"Thanks 。"`` in the issue's template: all three byte tokens of 。 train (before the fix: 1, 0, 0)."""
    chat = _chat("Thanks 。")
    ids, want, offsets = _oracle(folders["issue"], chat)
    tok, got = _ours(folders["issue"], chat)
    assert tok.has_generation_marks and got.ids == ids
    cjk = _byte_tokens(offsets, got.text, "。")
    assert len(cjk) == 3, "the test tokenizer must split 。 into its three bytes"
    assert [want[t] for t in cjk] == [1, 1, 1]
    assert got.assistant_mask.astype(int).tolist() == want


@pytest.mark.parametrize("reply", ["Thanks 。", "。Thanks", "é", "。 sunny é"])
@pytest.mark.parametrize("end_token", [True, False], ids=["end_token", "no_end_token"])
def test_marked_and_derived_spans_at_multibyte_edges(folders, reply, end_token):
    """A reply ending in, starting with, or being multi-byte characters: the marked path equals transformers'
    mask on the marked template, and the derived path (the same template without marks) equals it too."""
    suffix = "end" if end_token else "noend"
    chat = _chat(reply)
    ids, want, offsets = _oracle(folders[f"marked_{suffix}"], chat)
    tok, marked = _ours(folders[f"marked_{suffix}"], chat)
    assert tok.has_generation_marks and marked.ids == ids
    lo = marked.text.rindex(reply)
    reply_tokens = [t for t, (a, b) in enumerate(offsets) if a < lo + len(reply) and b > lo]
    assert reply_tokens and all(want[t] for t in reply_tokens)  # the oracle trains every byte token of the reply
    assert marked.assistant_mask.astype(int).tolist() == want
    tok, derived = _ours(folders[f"derived_{suffix}"], chat)
    assert not tok.has_generation_marks and derived.ids == ids
    assert derived.assistant_mask.astype(int).tolist() == want


# -- 2. MTP loss weight per family -------------------------------------------------------------------------


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


# -- 3. the MTP layer's router aux loss ----------------------------------------------------------------------

COEF = 0.01


def _moe_with_mtp(loss_weight: float):
    from tests.torch.st.qwen3_5_jobs import tiny_config

    torch.manual_seed(0)
    model = tiny_config(mtp_num_hidden_layers=1, mtp_loss_weight=loss_weight, router_aux_loss_coef=COEF).build()
    model.init_weights()
    return model


@pytest.mark.parametrize("loss_weight", [0.1, 0.5])
def test_mtp_router_aux_loss_has_the_full_coefficient(loss_weight):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    from hyper_parallel.data.packing import add_mtp_targets

    model = _moe_with_mtp(loss_weight)
    gate = model.mtp.layers[0].mlp.gate
    seen = []
    handle = gate.register_forward_hook(lambda mod, args, out: seen.append(out[2].detach()))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=g)
    batch = add_mtp_targets(
        {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(24)[None],
         "cu_seqlens": torch.tensor([0, 10, 24], dtype=torch.int32), "max_seqlen": 14}  # fmt: skip
    )
    kw = dict(position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"])
    with torch.no_grad():
        trunk = model(ids, **kw).aux_loss  # without MTP inputs: the trunk's aux loss only
        assert not seen
        both = model(ids, **kw, mtp_input_ids=batch["mtp_input_ids"]).aux_loss
    handle.remove()
    (scores_TE,) = seen
    # HF's Switch loss of that one layer (its softmax of log(p) is p: our router's own probabilities)
    switch = load_balancing_loss_func((scores_TE.log(),), num_experts=scores_TE.shape[-1], top_k=gate.config.top_k)
    assert switch > 0
    torch.testing.assert_close(both - trunk, COEF * switch, rtol=1e-5, atol=1e-9)


# -- 4. expert parallel: the experts' output is no view ------------------------------------------------------


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_experts_output_is_not_a_view(impl):
    """FSDP2 warns "returned a view tensor" for a unit (the experts under EP) whose output is an autograd view;
    the grouped kernel's path returned one (an identity autograd Function hands back its input as a view)."""
    from hyper_parallel.models.common.grouped_mm import can_use_grouped_mm
    from hyper_parallel.models.common.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts.Config(hidden_dim=16, grouped_mm_impl=impl).build(dim=16, num_experts=4)
    experts.init_weights()
    x = torch.randn(12, 16, requires_grad=True)
    if impl == "grouped_mm" and not can_use_grouped_mm(x, experts.gate_up_proj):
        pytest.skip("this torch build has no CPU grouped_mm")
    counts = torch.tensor([3, 0, 5, 4])
    y = experts(x, counts)
    assert y._base is None and not y._is_view()
    # and the gradients are the per-expert matmuls' (the identity still makes the incoming gradient contiguous)
    y.pow(2).sum().backward()
    ref_x = x.detach().clone().requires_grad_(True)
    w1, w2 = experts.gate_up_proj.detach(), experts.down_proj.detach()
    outs = []
    for e, (lo, hi) in enumerate([(0, 3), (3, 3), (3, 8), (8, 12)]):
        gate_up = ref_x[lo:hi] @ w1[e].T
        g_, u_ = gate_up.chunk(2, dim=-1)
        outs.append((torch.nn.functional.silu(g_) * u_) @ w2[e].T)
    torch.cat(outs).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-6)


# -- 6. intra-op threads -------------------------------------------------------------------------------------


def test_default_intra_op_threads():
    from hyper_parallel.distributed.env import MAX_INTRA_OP_THREADS, default_intra_op_threads

    assert default_intra_op_threads(cpus=2, local_world_size=1) == 1  # the busy 2-core box of the issue
    assert default_intra_op_threads(cpus=1, local_world_size=4) == 1
    assert default_intra_op_threads(cpus=16, local_world_size=2) == 7
    assert default_intra_op_threads(cpus=192, local_world_size=8) == MAX_INTRA_OP_THREADS == 8


def test_intra_op_threads_keeps_the_users_setting(monkeypatch, caplog):
    import logging

    from hyper_parallel.distributed.env import intra_op_threads

    before = torch.get_num_threads()
    log = logging.getLogger("test_review_defects")
    monkeypatch.setenv("OMP_NUM_THREADS", str(before))
    with caplog.at_level(logging.INFO, logger=log.name), intra_op_threads(log) as n:
        assert n == torch.get_num_threads() == before
    assert f"intra-op threads: {before} per rank (OMP_NUM_THREADS={before})" in caplog.text
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr("hyper_parallel.distributed.env.available_cpus", lambda: 9)
    with intra_op_threads(log) as n:
        assert n == torch.get_num_threads() == 4  # (9 - 1) // 2
    assert torch.get_num_threads() == before  # the caller's count is back


def test_plain_run_picks_and_logs_its_threads(tmp_path, monkeypatch, capfd):
    """``python -m hyper_parallel.train`` without OMP_NUM_THREADS (what torch would run: every core)."""
    from hyper_parallel.distributed.env import available_cpus, default_intra_op_threads
    from hyper_parallel.train import main
    from hyper_parallel.trainer import Trainer

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    want = default_intra_op_threads(cpus=available_cpus(), local_world_size=1)
    during = []
    train = Trainer.train

    def recording(self):
        during.append(torch.get_num_threads())
        return train(self)

    monkeypatch.setattr(Trainer, "train", recording)
    before = torch.get_num_threads()
    main(["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--training.steps", "1",
          "--checkpoint.enable", "False", "--dump_folder", str(tmp_path)])  # fmt: skip
    assert during == [want]
    assert torch.get_num_threads() == before
    assert f"intra-op threads: {want} per rank" in capfd.readouterr().err
