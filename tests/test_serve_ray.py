"""``speclm serve --ray --replicas 2`` on a local single-node Ray cluster: requests spread over
both replicas (each answers with its own process id) and every answer is the solo output."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from speclm.api import LLM  # noqa: E402
from speclm.sampling import SamplingParams  # noqa: E402

from speclm.serve.process import serve_process, stop  # noqa: E402

pytestmark = pytest.mark.ray


def test_ray_serve_replicas(model_dirs, tmp_path):
    solo = LLM(str(model_dirs["target"]), None, dtype="float64")
    prompts = ["the quick brown fox", "def add(a, b):", "the lazy dog. the lazy dog."]
    expected = {p: solo.generate(p, SamplingParams(max_tokens=40, ignore_eos=True))[0].text
                for p in prompts}
    args = ["--ray", "--replicas", "2", "--model", str(model_dirs["target"]), "--dtype", "float64",
            "--served-model-name", "tiny", "--shutdown-timeout", "5"]
    with serve_process(args, tmp_path, ready_timeout=240) as srv:
        client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="none", timeout=120,
                                    max_retries=0)

        async def one(i: int):
            prompt = prompts[i % len(prompts)]
            raw = await client.completions.with_raw_response.create(
                model="tiny", prompt=prompt, max_tokens=40, temperature=0, stream=i % 2 == 1,
                extra_body={"ignore_eos": True})
            replica = raw.headers["x-speclm-server"]
            out = raw.parse()
            text = "".join([c.choices[0].text async for c in out]) if i % 2 else out.choices[0].text
            return prompt, text, replica

        async def main():
            # the proxy learns about replicas as they come up: send rounds of concurrent
            # requests until both have answered
            results = []
            for _ in range(10):
                results += await asyncio.gather(*(one(i) for i in range(12)))
                if len({replica for _, _, replica in results}) == 2:
                    break
                await asyncio.sleep(2)
            await client.close()
            return results

        results = asyncio.run(asyncio.wait_for(main(), 240))
        assert all(text == expected[prompt] for prompt, text, _ in results)
        assert len({replica for _, _, replica in results}) == 2
        assert stop(srv.proc, timeout=120) in (0, -15), srv.output()
