"""What a chat request may send as a conversation: at most a set number of messages, each a role and text.
Gradio checks a ``gr.Chatbot`` value against its data model before any handler runs and answers a malformed
one with a validation error per message; ``bound_history`` gives the component a data model that refuses a long
or malformed history with one line first, and takes plain-text messages (``{"role", "content": str}``) as
the page's own text parts."""

from __future__ import annotations

import gradio as gr
from gradio.components.chatbot import ChatbotDataMessages
from pydantic import model_validator

ROLES = ("user", "assistant", "system")


class HistoryRefused(Exception):  # noqa: N818 - the message is what the client sees
    """A refused history. Not a ValueError: pydantic would wrap one into its own report, while any other
    exception leaves the validator as it is and the app (``show_error``) answers with its text alone."""


def _message(item: object, index: int) -> dict:
    if not isinstance(item, dict) or item.get("role") not in ROLES or "content" not in item:
        raise HistoryRefused(f"chat history message {index}: expected {{'role': 'user' or 'assistant', "
                             "'content': text}")
    content = item["content"]
    if isinstance(content, str):
        return {**item, "content": [{"type": "text", "text": content}]}
    if isinstance(content, dict):
        return {**item, "content": [content]}
    if not isinstance(content, list):
        raise HistoryRefused(f"chat history message {index}: content must be text")
    return item


def history_model(max_messages: int) -> type[ChatbotDataMessages]:
    """A Chatbot data model that refuses more than ``max_messages`` messages, or a malformed one, in one line."""

    class BoundedMessages(ChatbotDataMessages):
        @model_validator(mode="before")
        @classmethod
        def _bounded(cls, data):
            if data is None:
                return data
            if not isinstance(data, list):
                raise HistoryRefused("chat history must be a list of messages")
            if len(data) > max_messages:
                raise HistoryRefused(f"chat history has {len(data)} messages; at most {max_messages} are "
                                     "accepted: clear the chat and start again")
            return [_message(item, i) for i, item in enumerate(data)]

    return BoundedMessages


def bound_history(chatbot: gr.Chatbot, max_messages: int) -> gr.Chatbot:
    """``chatbot`` with its value checked by ``history_model(max_messages)``."""
    chatbot.data_model = history_model(max_messages)
    return chatbot
