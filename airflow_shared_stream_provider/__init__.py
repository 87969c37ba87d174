"""airflow-shared-stream-provider: many AssetWatchers, one broker connection, no lost message.

Importing this package has no side effects and loads no broker SDK.
"""

from __future__ import annotations

from airflow_shared_stream_provider._core.errors import RejectMessage, SharedStreamConfigError

__version__ = "0.1.0"

__all__ = ["RejectMessage", "SharedStreamConfigError", "__version__"]
