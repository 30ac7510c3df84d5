"""The Files API's settings: where files go, and S3 set up whole or refused at start."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from queen_server.files.blobs import LocalBlobs
from queen_server.files.s3 import S3Blobs
from queen_server.files.service import make_blobs
from queen_server.settings import QueenSettings


def test_files_go_to_a_folder_by_default(tmp_path):
    assert QueenSettings().files_dir.name == "files"
    blobs = make_blobs(QueenSettings(files_dir=tmp_path / "kept"))
    assert isinstance(blobs, LocalBlobs)
    assert blobs.root == tmp_path / "kept"
    assert not (tmp_path / "kept").exists()  # made on the first upload, not at start


def test_a_bucket_sends_them_to_s3_and_the_secret_stays_secret():
    settings = QueenSettings(files_s3_url="http://minio:9000", files_s3_bucket="apiary",
                             files_s3_access_key="id", files_s3_secret_key="hush")
    blobs = make_blobs(settings)
    assert isinstance(blobs, S3Blobs)
    assert blobs.describe() == "the S3 bucket apiary at http://minio:9000"
    assert "hush" not in repr(settings)


@pytest.mark.parametrize(("settings", "says"), [
    ({"files_s3_url": "http://minio:9000"}, "APIARY_FILES_S3_BUCKET"),
    ({"files_s3_bucket": "apiary", "files_s3_access_key": "id"}, "APIARY_FILES_S3_SECRET_KEY"),
    ({"files_s3_bucket": "Not_A_Bucket"}, "not an S3 bucket name"),
    ({"files_s3_bucket": "apiary", "files_s3_url": "minio:9000"}, "http:// or https://"),
    ({"files_max_examples": 9}, "files_max_examples"),
])
def test_a_half_configured_store_is_refused_at_start(settings, says):
    with pytest.raises(ValidationError) as caught:
        QueenSettings(**settings)
    assert says in str(caught.value)
