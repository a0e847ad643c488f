"""In-process clients with the official tinker SDK's API: `ember.ServiceClient()`.

A script written for `tinker.ServiceClient(base_url=...)` runs on `ember.ServiceClient()`
(no server, no HTTP) by changing that one line. See `ember.client.service_client`.
"""

from ember.client.rest import RestClient
from ember.client.sampling import SamplingClient
from ember.client.service_client import ServiceClient
from ember.client.training import TrainingClient

__all__ = ["RestClient", "SamplingClient", "ServiceClient", "TrainingClient"]
