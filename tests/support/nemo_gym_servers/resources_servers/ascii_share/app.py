"""A NeMo-Gym resources server for tests: the reward is the share of printable ASCII in the
policy's final answer, so a random tiny policy's samples get different rewards (NeMo-Gym's
example servers reward every rollout alike) and GRPO has advantages to train on."""

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)


class AsciiShareConfig(BaseResourcesServerConfig):
    pass


class AsciiShareServer(SimpleResourcesServer):
    config: AsciiShareConfig

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        text = ""
        for item in body.response.output:
            for part in getattr(item, "content", None) or []:
                text += getattr(part, "text", "") or ""
        share = sum(32 <= ord(c) < 127 for c in text) / len(text) if text else 0.0
        return BaseVerifyResponse(**body.model_dump(), reward=float(share))


if __name__ == "__main__":
    AsciiShareServer.run_webserver()
