"""The statuses a session's durable state is reported in: one enum whose values are the strings
on the wire (save and load results, the stop report, `ninfer ctl`, the request log's checkpoint
events, the checkpoint metrics' `outcome` label).

What a load finds (`LoadResult.state`): AVAILABLE (verified, and its tokens prefix the prompt),
MISSING (no generation, or none the prompt extends), INCOMPATIBLE (made by another runtime
fingerprint), CORRUPT (failed verification; quarantined).
How a restore ends (the `checkpoint_restore` event's outcome): RESTORED or NO_ROOM when the
load was available (NO_ROOM: running sequences hold the pool), else the load's state.
What a save did (`SaveResult.status`, the stop report's groups): SAVED, ALREADY_SAVED (the head
is on disk), NOTHING_TO_SAVE (the engine no longer holds the state), REFUSED (with a reason).
"""
from __future__ import annotations

from enum import StrEnum


class SessionStatus(StrEnum):
    AVAILABLE = "available"
    MISSING = "missing"
    INCOMPATIBLE = "incompatible"
    CORRUPT = "corrupt"
    RESTORED = "restored"
    NO_ROOM = "no_room"
    SAVED = "saved"
    ALREADY_SAVED = "already_saved"
    NOTHING_TO_SAVE = "nothing_to_save"
    REFUSED = "refused"


LOAD_STATES = (SessionStatus.AVAILABLE, SessionStatus.MISSING, SessionStatus.INCOMPATIBLE,
               SessionStatus.CORRUPT)
RESTORE_OUTCOMES = (SessionStatus.RESTORED, SessionStatus.NO_ROOM, SessionStatus.MISSING,
                    SessionStatus.INCOMPATIBLE, SessionStatus.CORRUPT)
# the stop report's groups, in its order
SAVE_OUTCOMES = (SessionStatus.SAVED, SessionStatus.ALREADY_SAVED,
                 SessionStatus.NOTHING_TO_SAVE, SessionStatus.REFUSED)
