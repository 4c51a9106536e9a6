"""A dead engine thread: in-flight requests end with an error, /health answers 503, nothing hangs."""

from __future__ import annotations

import asyncio
import logging
import threading

from aiohttp.test_utils import TestClient, TestServer

from ds4d.config import load_config
from ds4d.contracts import PluginContext
from ds4d.kernel import Kernel, LoadedModel
from tests.toy_model import ToyModel


class GatedExplodingModel(ToyModel):
    """Works until the gate opens, then raises on the next step."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.info = type(self.info)(**{**self.info.__dict__, "chat_template": "{{ messages[0]['content'] }}"})

    def forward(self, batch):
        if self.gate.is_set():
            raise RuntimeError("simulated device fault")
        self.gate.wait(0.01)
        return super().forward(batch)


def test_dead_engine_fails_in_flight_and_health_503(tmp_path):
    async def scenario():
        loaded = load_config({"max_num_seqs": 2}, environ={"DS4D_CONFIG": str(tmp_path / "none.toml")})
        kernel = Kernel(loaded)
        model = GatedExplodingModel()
        state = kernel.build(LoadedModel(model, "toy", tmp_path), asyncio.get_running_loop())
        from ds4d.server.app import build_app

        client = TestClient(TestServer(build_app(state)))
        await client.start_server()
        watchdog = asyncio.create_task(kernel._watchdog())
        try:
            assert (await client.get("/health")).status == 200
            body = {"model": state.served_model_name, "prompt": [1, 2, 3], "max_tokens": 10000,
                    "temperature": 0, "ignore_eos": True}
            pending = asyncio.create_task(client.post("/v1/completions", json=body))
            await asyncio.sleep(0.3)
            model.gate.set()
            resp = await asyncio.wait_for(pending, 10)
            assert resp.status == 500
            err = (await resp.json())["error"]
            assert "simulated device fault" in err["message"] and err["code"] == "generation_failed"
            health = await client.get("/health")
            assert health.status == 503
            assert "simulated device fault" in (await health.json())["reason"]
            again = await client.post("/v1/completions", json=body)
            assert again.status == 503
            assert (await again.json())["error"]["code"] == "engine_dead"
        finally:
            watchdog.cancel()
            await client.close()
            kernel.engine.stop(1)

    asyncio.run(scenario())
