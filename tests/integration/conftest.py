"""Fixtures for the integration tests: conversations, a local S3 endpoint (moto) on 127.0.0.1."""

from __future__ import annotations

import socket

import pytest


def conversations(n: int = 6) -> list[dict]:
    return [{"id": f"c{i:02d}", "domain": "math", "messages": [
        {"role": "user", "content": f"What is {i} plus {i + 1}? Explain step by step."},
        {"role": "assistant", "content": f"We add {i} and {i + 1}. The sum of these two numbers is "
                                         f"{2 * i + 1}, so the answer is {2 * i + 1}."}]}
            for i in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 with bucket ``dspark-test``; yields s3fs storage options."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    url = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=url, aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(
        Bucket="dspark-test")
    yield {"endpoint_url": url, "key": "testing", "secret": "testing",
           "client_kwargs": {"region_name": "us-east-1"}}
    server.stop()
