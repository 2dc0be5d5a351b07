"""The record format, once: the fields and their rules (schema), the
writer's record and its JSON line (format), parsing lines back (parse) and
arrays kept as raw bytes until written (rawarray). The layer's one entry."""

from pmaptap.tapfile import loaded_on_use
from pmaptap.tapfile.record.format import (
    COORDS_COLUMN_PREFIX,
    COUNT_BASE,
    META_ATTEMPT,
    META_DROPPED,
    META_REFUSED,
    META_UNENCODABLE,
    ORJSON,
    ORJSON_OPTS,
    RECORD_COLUMNS,
    SUMMARY_FIELDS,
    Record,
    check_step_range,
    check_text,
    coords_column,
    decode_record,
    decoded,
    encodable,
    encode_line,
    index_text,
    is_complex,
    is_float_like,
    is_narrow_int,
    key_with_step,
    meta_record,
    new_record,
    split_step,
)
from pmaptap.tapfile.record.parse import (
    decode_block,
    decode_line,
    line_problem,
    parse_line,
)
from pmaptap.tapfile.record.rawarray import RawArray, has_raw, raw_leaves
from pmaptap.tapfile.record.schema import (
    CLASSES,
    COPIES_SEEN,
    FINGERPRINT,
    KINDS,
    MAX_STEP,
    NAN,
    NEG_INF,
    NONFINITE,
    POS_INF,
    RANGES_ABOVE,
    UNSET,
    VALUE_KINDS,
    AnyRecord,
    Holders,
    PerDevice,
    Replicated,
    as_dicts,
    curve_tag,
    first_holder,
    format_problems,
    from_dict,
    holder_ids,
    holders_field,
    holds,
    index_key,
    is_ref,
    part_key,
    ranges_text,
    record_key,
    shown_name,
    step_key,
    validate_dict,
)

# A limit read at each use from its module: set there (in a test), it
# holds for every reader.
_LIVE = {"MAX_LINE_BYTES": "parse"}


__getattr__ = loaded_on_use(__name__, _LIVE, attribute=True)
