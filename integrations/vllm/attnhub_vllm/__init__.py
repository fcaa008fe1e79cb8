"""attnhub-vllm: vLLM's attention through any attnhub backend.

Importing this package does not import vLLM; ``attnhub_vllm.backend`` does (vLLM imports it by
class path once the plugin has registered it).
"""

__version__ = "0.1.0"

BACKEND_CLASS_PATH = "attnhub_vllm.backend.AttnhubVllmBackend"
MLA_BACKEND_CLASS_PATH = "attnhub_vllm.mla.AttnhubVllmMLABackend"
