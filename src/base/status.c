#include "base/status.h"

const char *di_status_str(di_status st) {
    switch (st) {
    case DI_OK:
        return "ok";
    case DI_ERR_NOMEM:
        return "out of memory";
    case DI_ERR_IO:
        return "i/o error";
    case DI_ERR_FORMAT:
        return "bad file format";
    case DI_ERR_INVALID:
        return "invalid argument";
    case DI_ERR_NO_KV:
        return "out of KV cache";
    case DI_ERR_CUDA:
        return "CUDA error";
    case DI_ERR_CANCELLED:
        return "cancelled";
    case DI_ERR_UNSUPPORTED:
        return "unsupported";
    case DI_ERR_BUSY:
        return "busy (request queue full)";
    case DI_ERR_DEVICE_LOST:
        return "device lost (a sticky device error; the device must be reset)";
    }
    return "unknown status";
}
