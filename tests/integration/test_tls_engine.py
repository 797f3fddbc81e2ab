"""TLS to engines (issue 14 item 7): the gateway in front of a simulator serving HTTPS with a test CA's
certificate. Requests (streaming and not, through the openai SDK), health probes and metric scrapes go over
TLS; SNI is sent (the URL's host, or `tls.server_name`); a certificate from another CA is a clear 502;
`verify: false` works; bad TLS options are configuration errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import trustme

from lockgate.config import ConfigError, parse_config
from lockgate.sim import SimServer


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, str]:
    """A CA, an engine certificate for 127.0.0.1 / localhost / engine.test, and another CA's certificate."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost", "engine.test")
    paths = {
        "ca": tmp_path / "ca.pem",
        "other_ca": tmp_path / "other-ca.pem",
        "cert": tmp_path / "engine.pem",
        "key": tmp_path / "engine.key",
    }
    ca.cert_pem.write_to_path(str(paths["ca"]))
    trustme.CA().cert_pem.write_to_path(str(paths["other_ca"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    with open(paths["cert"], "wb") as f:
        for blob in cert.cert_chain_pems:
            f.write(blob.bytes())
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture
async def tls_sim(start_sim: Any, pki: dict[str, str]) -> SimServer:
    sim: SimServer = await start_sim(tls_cert=pki["cert"], tls_key=pki["key"])
    assert sim.url.startswith("https://127.0.0.1:")
    return sim


def model(url: str, **tls: Any) -> list[dict[str, Any]]:
    return [{"name": "m", "retries": 0, "instances": [{"url": url, "engine": "vllm", "name": "tls", "tls": tls}]}]


MESSAGES: Any = [{"role": "user", "content": "hello over TLS"}]


async def test_requests_probes_and_scrapes_go_over_tls(start_gateway, tls_sim, pki):
    gw = await start_gateway(model(tls_sim.url, ca_file=pki["ca"]), scrape={"enabled": False})
    fleet = gw.gateway.fleet
    await fleet.probe_all()
    instance = fleet.instances[tls_sim.url]
    assert instance.healthy, instance.last_error
    await fleet.scraper.scrape_all()
    assert instance.engine_load is not None, instance.scrape_error
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        whole = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, temperature=0)
        assert whole.choices[0].message.content
        stream = await client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=8, temperature=0, stream=True
        )
        parts = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    assert "".join(parts) == whole.choices[0].message.content
    assert tls_sim.statistics()["requests_finished"] >= 1
    assert tls_sim.last_server_name is None  # 127.0.0.1: no SNI for an IP address (RFC 6066)


async def test_sni_is_the_url_host_or_the_configured_server_name(start_gateway, tls_sim, pki):
    by_host = tls_sim.url.replace("127.0.0.1", "localhost")
    gw = await start_gateway(model(by_host, ca_file=pki["ca"]), scrape={"enabled": False})
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        assert tls_sim.last_server_name == "localhost"
        await gw.shutdown()
    gw = await start_gateway(model(tls_sim.url, ca_file=pki["ca"], server_name="engine.test"))
    await gw.gateway.fleet.probe_all()  # the aiohttp side (probes) sends it too
    assert tls_sim.last_server_name == "engine.test"
    tls_sim.last_server_name = None
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, stream=False)
    assert tls_sim.last_server_name == "engine.test"


async def test_a_certificate_from_another_ca_is_a_clear_502_and_verify_false_accepts_it(start_gateway, tls_sim, pki):
    gw = await start_gateway(model(tls_sim.url, ca_file=pki["other_ca"]), scrape={"enabled": False})
    fleet = gw.gateway.fleet
    await fleet.probe_all()
    instance = fleet.instances[tls_sim.url]
    assert not instance.healthy and "certificate" in (instance.last_error or "").lower()
    instance.healthy = True  # believed healthy (before its first probe): the request itself fails
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        with pytest.raises(openai.InternalServerError) as failed:
            await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert failed.value.status_code == 502
    error = failed.value.body
    assert isinstance(error, dict) and error["code"] == "upstream_unreachable"
    assert error["message"] == "Cannot connect to instance tls: its TLS certificate was rejected."
    assert tls_sim.statistics()["requests_started"] == 0
    await gw.shutdown()
    gw = await start_gateway(model(tls_sim.url, verify=False), scrape={"enabled": False})
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        answer = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert answer.choices[0].message.content


def test_tls_options_are_checked_at_load(pki, tmp_path):
    def load(instance: dict[str, Any]) -> None:
        parse_config({"models": [{"name": "m", "instances": [instance]}]})

    load({"url": "https://e:8443", "tls": {"ca_file": pki["ca"], "cert_file": pki["cert"], "key_file": pki["key"]}})
    with pytest.raises(ConfigError, match=r"models\[0\].instances\[0\]: .*https:// instances only"):
        load({"url": "http://e:8000", "tls": {"verify": False}})
    with pytest.raises(ConfigError, match=r"instances\[0\].tls: .*cannot use ca_file .*No such file"):
        load({"url": "https://e", "tls": {"ca_file": str(tmp_path / "missing.pem")}})
    with pytest.raises(ConfigError, match=r"instances\[0\].tls: .*key_file needs cert_file"):
        load({"url": "https://e", "tls": {"key_file": pki["key"]}})
    with pytest.raises(ConfigError, match=r"instances\[0\].tls: .*cannot use cert_file"):
        load({"url": "https://e", "tls": {"cert_file": pki["ca"]}})  # a certificate without its key
