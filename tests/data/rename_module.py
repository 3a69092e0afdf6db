import json
import os
from dataclasses import dataclass


@dataclass
class Record:
    name: str
    size: int
    tags: list


def load_records(path):
    """Read the records of a JSON file."""
    with open(path) as handle:
        raw = json.load(handle)
    records = []
    for item in raw:
        records.append(Record(item["name"], int(item["size"]), list(item.get("tags", []))))
    return records


def total_size(records):
    """The sum of the records' sizes."""
    total = 0
    for record in records:
        total += record.size
    return total


def largest(records, count=3):
    """The `count` largest records, largest first."""
    ordered = sorted(records, key=lambda record: record.size, reverse=True)
    return ordered[:count]


def by_tag(records):
    """The records grouped by tag."""
    groups = {}
    for record in records:
        for tag in record.tags:
            groups.setdefault(tag, []).append(record)
    return groups


def save_summary(records, path):
    """Write the count, total and largest names to a JSON file."""
    summary = {
        "count": len(records),
        "total": total_size(records),
        "largest": [record.name for record in largest(records)],
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(summary, handle, indent=2)
    os.replace(tmp, path)
    return summary
