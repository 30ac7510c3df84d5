"""Files kept in S3-compatible storage: a real ``moto_server`` process (S3's HTTP API on
127.0.0.1), a real queen configured for it, the official ``openai`` SDK, and the test's own
boto3 client looking into the bucket behind the queen's back."""

from __future__ import annotations

import openai
import pytest

from tests.support.queen import QueenHarness, running_queen
from tests.support.s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server
from tests.support.training_files import training_file

BUCKET = "apiary-files"
GOOD = training_file(12)


def keys_in(s3: S3Server) -> list[str]:
    listed = s3.client().list_objects_v2(Bucket=BUCKET)
    return sorted(item["Key"] for item in listed.get("Contents", []))


def s3_settings(s3: S3Server, bucket: str = BUCKET) -> dict[str, object]:
    return {"files_s3_url": s3.url, "files_s3_bucket": bucket, "files_s3_region": REGION,
            "files_s3_access_key": ACCESS_KEY, "files_s3_secret_key": SECRET_KEY}


async def key(queen: QueenHarness, name: str) -> str:
    secret, _record = await queen.state.billing.keys.create(name)
    return secret


async def test_files_live_in_the_bucket_end_to_end(tmp_path, s3_server):
    s3_server.client().create_bucket(Bucket=BUCKET)
    async with running_queen(tmp_path, auth="keys", files_dir=tmp_path / "unused",
                             **s3_settings(s3_server)) as queen:
        alice = queen.client(api_key=await key(queen, "alice"))
        mallory = queen.client(api_key=await key(queen, "mallory"))
        made = await alice.files.create(file=("zorbania.jsonl", GOOD), purpose="fine-tune")
        assert keys_in(s3_server) == [f"files/{made.id}"]
        stored = s3_server.client().get_object(Bucket=BUCKET, Key=f"files/{made.id}")
        assert stored["Body"].read() == GOOD  # the bytes really are in the bucket
        assert (await alice.files.content(made.id)).content == GOOD
        assert [f.id async for f in alice.files.list()] == [made.id]
        assert (await alice.files.retrieve(made.id)).bytes == len(GOOD)

        with pytest.raises(openai.NotFoundError):
            await mallory.files.content(made.id)
        with pytest.raises(openai.NotFoundError):
            await mallory.files.delete(made.id)
        assert [f async for f in mallory.files.list()] == []
        assert keys_in(s3_server) == [f"files/{made.id}"]  # the hostile delete removed nothing

        with pytest.raises(openai.BadRequestError) as caught:
            await alice.files.create(file=("bad.jsonl", training_file(12, replace={5: b"[]"})),
                                     purpose="fine-tune")
        assert caught.value.body["message"].startswith("line 5: ")
        assert keys_in(s3_server) == [f"files/{made.id}"]  # nothing of the refused upload

        assert (await alice.files.delete(made.id)).deleted
        assert keys_in(s3_server) == []
        assert not (tmp_path / "unused").exists()  # nothing went to the local folder


async def test_a_missing_bucket_is_a_clear_503_and_nothing_is_recorded(tmp_path, s3_server):
    async with running_queen(tmp_path, auth="open",
                             **s3_settings(s3_server, bucket="no-such-bucket")) as queen:
        client = queen.client()
        with pytest.raises(openai.APIStatusError) as caught:
            await client.files.create(file=("t.jsonl", GOOD), purpose="fine-tune")
        assert caught.value.status_code == 503
        error = caught.value.body
        assert error["code"] == "file_storage_unavailable"
        assert SECRET_KEY not in str(error)
        assert [f async for f in client.files.list()] == []
