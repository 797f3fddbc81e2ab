"""The start-up banner's "Try it" lines work as pasted: with tenant keys configured they say where a key goes."""

from __future__ import annotations

from lockgate.admission.tenants import hash_key
from lockgate.server import _banner
from tests.conftest import instance


async def test_the_try_it_lines_carry_a_key_only_where_one_is_needed(start_sim, start_gateway):
    sim = await start_sim()
    models = [{"name": "m", "instances": [instance(sim)]}]
    open_gateway = _banner(await start_gateway(models))
    assert "Authorization" not in open_gateway and 'api_key="unused"' in open_gateway
    keyed = _banner(await start_gateway(models, tenants=[{"name": "t", "keys": [hash_key("sk-t")]}]))
    assert "-H 'Authorization: Bearer <a tenant key>'" in keyed and 'api_key="<a tenant key>"' in keyed
    # No admin key with tenant keys: the operator routes answer 403, and the banner says they are closed.
    assert "/admin/fleet   (closed: no `admin.keys` configured)" in keyed
    assert "closed" not in open_gateway
    with_admin = _banner(
        await start_gateway(
            models, tenants=[{"name": "t", "keys": [hash_key("sk-t")]}], admin={"keys": [hash_key("sk-admin")]}
        )
    )
    assert "closed" not in with_admin
