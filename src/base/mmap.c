#include "base/mmap.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"

di_status di_mmap_open(const char *path, di_mmap *out) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        DI_LOG_ERROR("cannot open %s: %s", path, strerror(errno));
        return DI_ERR_IO;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        DI_LOG_ERROR("%s: not a regular file", path);
        close(fd);
        return DI_ERR_IO;
    }
    const unsigned char *data = NULL;
    if (sb.st_size > 0) {
        void *p = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            DI_LOG_ERROR("cannot map %s: %s", path, strerror(errno));
            close(fd);
            return DI_ERR_IO;
        }
        data = p;
    }
    close(fd); // the mapping keeps the file alive
    out->data = data;
    out->size = (size_t)sb.st_size;
    return DI_OK;
}

void di_mmap_close(di_mmap *m) {
    if (m->data) munmap((void *)m->data, m->size);
    m->data = NULL;
    m->size = 0;
}
