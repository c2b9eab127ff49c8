"""kombu's file transport, with messages written atomically: the demo's embedded broker.

kombu's ``filesystem://`` transport writes a message into the queue folder under its final name, and
a consumer may take the file between its creation and its write: it reads an empty file and the
worker stops with ``Unrecoverable error: JSONDecodeError`` (seen in the demo on a loaded machine, as
"the job never started"). Here a message is written under a name no consumer reads (``.tmp``), then
renamed into place, which is atomic on one file system.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps

__all__ = ["Transport"]


class Channel(filesystem.Channel):
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"  # what kombu's consumers read
        path = os.path.join(self.data_folder_out, name)
        partial = f"{path}.tmp"  # not '<queue>.msg' after its first dot: no consumer takes it
        try:
            with open(partial, "wb") as file:
                file.write(str(dumps(payload)).encode("utf-8"))  # type: ignore[no-untyped-call]
            os.replace(partial, path)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {path!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel
