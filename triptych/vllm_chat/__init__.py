"""vLLM as the chat engine behind Triptych's encoders (an E/PD split: Triptych encodes, vLLM decodes).

``config.VllmConfig`` is what ``triptych serve --chat-engine vllm`` reads; ``server.VllmServer`` runs
vLLM's OpenAI server from its own environment (``install_vllm.sh`` makes ``.venv-vllm``) as a child
process of the head; ``engine.VllmChatEngine`` is the encoder's client: it sends a chat with the
image embeddings the encoder computed (its mm-hash cache) and hands back the answer piece by piece.
The model-specific parts (which files vLLM needs, how an image becomes an embedding item) live in
the family (``triptych.families.qwenimage.vllm``).
"""

from triptych.vllm_chat.config import VllmConfig

__all__ = ["VllmConfig"]
