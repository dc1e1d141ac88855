"""The VLM understanding path: chat about images with the encoder's own vision-language model."""

from triptych.chat.vlm import ChatModel, ChatParams, ChatResult, ChatTurn

__all__ = ["ChatModel", "ChatParams", "ChatResult", "ChatTurn"]
