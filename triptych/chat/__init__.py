"""The VLM understanding path: chat about images with the encoder's own vision-language model.

The package exports the plain request and answer values (``triptych.chat.params``), which import without
torch; the model that answers them is ``triptych.chat.vlm.ChatModel``."""

from triptych.chat.params import ChatParams, ChatResult, ChatTurn

__all__ = ["ChatParams", "ChatResult", "ChatTurn"]
