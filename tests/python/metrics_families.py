"""Parses scraped /metrics bodies with the official Prometheus client's
OpenMetrics parser (the format sandbolt serves, content type
application/openmetrics-text; the parser rejects anything that is not
valid OpenMetrics, a missing `# EOF` included).

  python metrics_families.py NAME=FILE...

Prints {"NAME": [{"name", "type", "samples": [{"name", "labels", "value"}]}]}
as JSON; a file that does not parse fails the run with the parser's error.
"""

import json
import sys

from prometheus_client.openmetrics.parser import text_string_to_metric_families


def families(text):
    return [
        {
            "name": f.name,
            "type": f.type,
            "samples": [{"name": s.name, "labels": s.labels, "value": s.value} for s in f.samples],
        }
        for f in text_string_to_metric_families(text)
    ]


def main(args):
    out = {}
    for arg in args:
        name, _, path = arg.partition("=")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            out[name] = families(text)
        except Exception as e:  # the parser raises ValueError and friends
            raise SystemExit(f"{name} ({path}) is not valid OpenMetrics: {e!r}")
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
