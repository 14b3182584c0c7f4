"""The Elasticsearch event sink (DESIGN.md section 7).

Imported only when the ``mongo`` backend is configured: the embedded default never imports
the Elasticsearch client.
"""

from wowd.stores.elasticsearch.sink import ElasticsearchEventSink, events_mapping, index_name

__all__ = ["ElasticsearchEventSink", "events_mapping", "index_name"]
