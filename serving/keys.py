"""The app's typed keys: what `create_app` stores on the application (and on each request) for the routes to
read. Routes import these, never the app factory, so the factory can import the routes."""

from __future__ import annotations

import asyncio
import weakref

from aiohttp import web

from serving.bridge import AsyncEngine
from serving.http_api.auth import Keyring
from qtts_jax.engine.core_client import CoreClient
from serving.monitoring.metrics import Metrics
from serving.admission import Admission
from serving.settings import Settings
from serving.voice.store import VoiceStore

SETTINGS = web.AppKey("settings", Settings)
MODEL = web.AppKey("model", object)
SERVED_NAMES = web.AppKey("served_names", tuple)  # model names a request may ask for: this model's and generic
ENGINE = web.AppKey("engine", CoreClient)  # the engine core's client: in its own process, or on a thread
BRIDGE = web.AppKey("bridge", AsyncEngine)
ADMISSION = web.AppKey("admission", Admission)
METRICS = web.AppKey("metrics", Metrics)
SOCKETS = web.AppKey("sockets", weakref.WeakSet)
WARMUP_TASK = web.AppKey("warmup_task", asyncio.Task)
WARMUP_ERROR = web.AppKey("warmup_error", list)
VOICES = web.AppKey("voices", VoiceStore)  # set only for Base models
VOICE_WARMUP = web.AppKey("voice_warmup", list)  # the background encoder compilation, once started
API_KEYS = web.AppKey("api_keys", Keyring)  # the keys requests must present (none: every path is open)
ALIASES = web.AppKey("aliases", dict)  # OpenAI voice name -> speaker (CustomVoice) or registered voice (Base)

REQUEST_ID = web.RequestKey("request_id", str)  # set by the speech route, echoed on its error responses
