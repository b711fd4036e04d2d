"""The server with other drafters than prompt lookup, through the official ``openai`` client:
suffix matching, a draft model, early exit and an EAGLE head, four concurrent requests each,
every greedy answer equal to plain decoding's, the drafter reported per response and per
drafter in /metrics."""

from __future__ import annotations

import threading

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from speclm.api import LLM  # noqa: E402
from speclm.learned.checkpoint import DrafterConfig, TargetIdentity, save_weights  # noqa: E402
from speclm.learned.modules import EagleHead  # noqa: E402
from speclm.sampling import SamplingParams  # noqa: E402
from speclm.serve.launch import ServeOptions, build_app  # noqa: E402

PROMPTS = ["the quick brown fox", "def add(a, b):", "the lazy dog. the lazy dog.", "naïve café"]


@pytest.fixture(scope="module")
def eagle_dir(model_dirs, tmp_path_factory):
    """An untrained EAGLE head for the tiny target, saved as `speclm train-drafter` saves one."""
    target = AutoModelForCausalLM.from_pretrained(model_dirs["target"], dtype=torch.float64)
    vocab = target.config.vocab_size
    torch.manual_seed(0)
    head = EagleHead.create(target, [1, 2], torch.arange(vocab)).double()
    out = tmp_path_factory.mktemp("eagle")
    DrafterConfig("eagle", TargetIdentity.of(target, "tiny"), vocab, [1, 2]).save(out)
    save_weights(head, out)
    return out


@pytest.fixture(scope="module")
def solo(model_dirs):
    return LLM(str(model_dirs["target"]), None, dtype="float64")


@pytest.mark.parametrize("drafter", ["suffix", "draft", "early-exit", "eagle"])
def test_server_with_a_drafter_answers_like_plain_decoding(drafter, model_dirs, eagle_dir, solo, monkeypatch):
    from speclm.drafters.draft_rows import DraftRows
    from speclm.drafters.layer_skip import LayerSkipRows

    batched: list[int] = []  # rows per batched draft call (a draft model, early exit: all rows at once)
    for group in (DraftRows, LayerSkipRows):
        monkeypatch.setattr(group, "propose_rows", lambda self, members, ctxs, f=group.propose_rows:
                            batched.append(len(members)) or f(self, members, ctxs))
    spec = {"suffix": "suffix", "draft": f"draft:path={model_dirs['draft']}", "early-exit": "early-exit:layers=1",
            "eagle": f"eagle:path={eagle_dir},tree=3"}[drafter]
    opts = ServeOptions(model=str(model_dirs["target"]), dtype="float64", max_batch=4, max_queue=4,
                        served_model_name="tiny", draft_max=4, adaptive=False)  # a fixed cap: drafts
    opts.drafter = spec                                                    # whatever the machine's load
    with TestClient(build_app(opts), base_url="http://localhost") as http:
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="none", http_client=http,
                               max_retries=0)
        answers: dict[int, object] = {}

        def ask(i: int) -> None:
            answers[i] = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": PROMPTS[i]}], max_tokens=16,
                temperature=0, extra_body={"ignore_eos": True})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            expected = solo.chat([{"role": "user", "content": prompt}], params, speculative=False).text
            assert answers[i].choices[0].message.content == expected, f"{drafter}: request {i}"
            assert answers[i].model_extra["speclm"]["drafter"].startswith(spec.partition(":")[0])
        assert sum(a.model_extra["speclm"]["drafted_tokens"] for a in answers.values()) > 0
        assert bool(batched) == (drafter in ("draft", "early-exit"))
        metrics = http.get("/metrics").text
        assert f'speclm_drafter_requests_total{{drafter="{answers[0].model_extra["speclm"]["drafter"]}"}} 4.0' in metrics
