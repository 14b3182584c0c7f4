"""The Elasticsearch event sink (docs/stores.md).

Imported only when the ``mongo`` backend is configured: the embedded default never imports
the Elasticsearch client.
"""

from wowd.stores.elasticsearch.documents import events_mapping, index_name
from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

__all__ = ["ElasticsearchEventSink", "events_mapping", "index_name"]
