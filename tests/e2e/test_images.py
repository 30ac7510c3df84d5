"""Image generation end to end (issue 38): a queen process, a headless ``apiary-worker`` that
opted in to images (``--images``) serving a diffusion model file (the tests' random-weight
SDXS-512-DS, written once per session: ``tests/support/diffusion_models.py``), and a developer
with the official openai SDK and a funded key. The worker renders in its sandboxed image child
with the real stable-diffusion.cpp; the developer gets PNGs of the size asked for, ``n`` of them
with consecutive seeds, the same image again for the same seed; the key is charged the queen's
own count and ``apiary-queen ledger check`` is clean. A key with no balance is refused before
anything runs, a bad size names its field, and a chat request to the image model names
``model``. A worker that did not opt in announces no diffusion model. A worker that returns
random pixels (``tests/support/cheats.py``'s ``image_noise``) is flagged by the audits: the
operator's trusted auditor renders its orders again, the victims are refunded."""

from __future__ import annotations

import base64
import functools
import io
import json

import httpx
import openai
import pytest
from PIL import Image

from tests.support import admin_keys
from tests.support.admin_keys import worker_key
from tests.support.cheats import cheat_process
from tests.support.diffusion_fixture import diffusion_model  # noqa: F401  (a fixture)
from tests.support.diffusion_models import WrittenModel
from tests.support.processes import (
    free_port,
    health,
    queen_cli,
    queen_process,
    running,
    wait_for,
    worker_process,
)

ADMIN = "images-admin-token"
EXTRA = {"seed": 11, "steps": 2, "guidance": 1.0}

pytestmark = pytest.mark.timeout(600)


def model_kinds(port: int, key: str) -> dict[str, str]:
    try:
        listed = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5,
                           headers={"Authorization": f"Bearer {key}"}).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return {m["id"]: m["apiary"]["kind"] for m in listed.get("data", [])}


funded_client = functools.partial(admin_keys.funded_client, admin_token=ADMIN, name="artist",
                                  timeout_s=300)
key_available_msat = functools.partial(admin_keys.key_available_msat, admin_token=ADMIN)


def png(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image


def test_a_developer_makes_images_on_a_volunteers_worker(tmp_path, diffusion_model):  # noqa: F811
    model: WrittenModel = diffusion_model
    name = model.path.stem
    port = free_port()
    queen = queen_process(tmp_path, port, auth="keys", admin_token=ADMIN, audits="false",
                          heartbeat_interval_s="2", total_timeout_s="300",
                          first_token_timeout_s="300")
    folder = tmp_path / "artist"
    folder.mkdir()
    worker = worker_process(folder, port, [str(model.path)], "--images", "--threads", "2")
    plain = tmp_path / "plain"
    plain.mkdir()
    other = worker_process(plain, port, [str(model.path)], "--threads", "2")
    with running(queen, worker, other):
        queen.start()
        worker.start()
        other.start()
        wait_for(lambda: health(port).get("workers", 0) >= 2, 180,
                 "both workers to import the diffusion model and join")
        client, key_id = funded_client(port, 5000)
        assert model_kinds(port, client.api_key) == {name: "image"}  # none from the plain one

        poor, _ = funded_client(port, 0)
        with pytest.raises(openai.APIStatusError) as caught:
            poor.images.generate(model=name, prompt="a hive", size="64x64", extra_body=EXTRA)
        assert caught.value.status_code == 402

        client.images.generate(model=name, prompt="proof", size="64x64", extra_body=EXTRA)
        before = key_available_msat(port, key_id)
        answer = client.images.generate(model=name, prompt="a beehive at dawn", size="64x64",
                                        n=2, extra_body=EXTRA)
        first, second = (png(item.b64_json) for item in answer.data)
        assert (first.format, first.size) == ("PNG", (64, 64))
        assert (second.format, second.size) == ("PNG", (64, 64))
        assert first.tobytes() != second.tobytes()  # seeds 11 and 12
        assert len(set(first.tobytes())) > 1  # not a blank image
        assert answer.model_extra["apiary"]["seeds"] == [11, 12]
        charged = before - key_available_msat(port, key_id)
        assert charged > 0

        again = client.images.generate(model=name, prompt="a beehive at dawn", size="64x64",
                                       extra_body={**EXTRA, "seed": 12})
        assert png(again.data[0].b64_json).tobytes() == second.tobytes()

        with pytest.raises(openai.BadRequestError) as caught:
            client.images.generate(model=name, prompt="x", size="100x100")
        assert caught.value.body["param"] == "size"
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=name,
                                           messages=[{"role": "user", "content": "hi"}])
        assert caught.value.body["code"] == "model_makes_images"
        check = queen_cli(tmp_path, "ledger", "check")
        assert check.returncode == 0, check.stdout + check.stderr
        assert "image engine:" in worker.log()  # rendered in its image child


def audit_report(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/admin/api/audits", timeout=10,
                     headers={"Authorization": f"Bearer {ADMIN}"}).json()


def test_a_worker_returning_random_pixels_is_flagged_and_its_victims_refunded(
        tmp_path, diffusion_model):  # noqa: F811
    model: WrittenModel = diffusion_model
    name = model.path.stem
    auditor_dir = tmp_path / "auditor"
    auditor_dir.mkdir()
    auditor_key = worker_key(auditor_dir / "worker-key.pem")
    port = free_port()
    queen = queen_process(tmp_path, port, auth="keys", admin_token=ADMIN, escrow_jobs="50",
                          heartbeat_interval_s="2", total_timeout_s="300",
                          first_token_timeout_s="300", audit_new_rate="1.0",
                          trusted_auditors=auditor_key,
                          local_model_pins=json.dumps({name: [model.sha256]}))
    auditor = worker_process(auditor_dir, port, [str(model.path)], "--images", "--threads", "2")
    auditor.env["APIARY_AUDITOR"] = "true"
    cheat = cheat_process(tmp_path, port, "image_noise", [str(model.path)])
    with running(queen, auditor, cheat):
        queen.start()
        auditor.start()
        cheat.start()
        wait_for(lambda: health(port).get("workers", 0) >= 2, 180,
                 "the auditor and the cheat to import the model and join")
        client, key_id = funded_client(port, 1000)
        before = key_available_msat(port, key_id)
        def audited() -> int:  # the cheat's audits so far (the auditor is never audited)
            return sum(e["audited"] for e in audit_report(port)["standings"])

        for i in range(8):  # each job goes to the cheat, the only one serving
            client.images.generate(model=name, prompt=f"a hive, take {i}", size="64x64",
                                   extra_body=EXTRA)
            # Its audit runs after the answer: wait for it, so the next job is sent only to a
            # cheat the audits have not flagged yet (a job served after a flag is not drawn).
            wait_for(lambda i=i: audited() >= i + 1, 60, f"job {i}'s audit")
            if any(e["state"] == "flagged" for e in audit_report(port)["standings"]):
                break
        [flagged] = [e for e in audit_report(port)["standings"] if e["state"] == "flagged"]

        def evidence() -> list[dict]:
            entry = next((e for e in audit_report(port)["standings"]
                          if e["worker"] == flagged["worker"]), None)
            return entry["evidence"] if entry else []

        wait_for(lambda: evidence() and all(row["failed"] and row["trusted"] and row["refunded"]
                                            for row in evidence()), 30,
                 "every failed job refunded")
        assert len(evidence()) >= 2  # no single job flags
        assert key_available_msat(port, key_id) == before  # every audited job paid back
        with pytest.raises(openai.NotFoundError):  # out of routing (the auditor only audits)
            client.images.generate(model=name, prompt="a hive", size="64x64", extra_body=EXTRA)
        check = queen_cli(tmp_path, "ledger", "check")
        assert check.returncode == 0, check.stdout + check.stderr
        assert "image engine:" in auditor.log()  # it rendered the orders again, for real
