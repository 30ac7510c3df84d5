"""The Files API's room (issue 37): uploads for fine-tuning, checked (``validation``, pure),
their bytes kept in a folder or an S3-compatible bucket (``blobs``, ``s3``), their records in
the queen's database (``records``), owned by the caller that uploaded them (``service``). The
routes are ``http/files.py``."""
