// dsv4 — DeepSeek V4 model load, the decoder layer loop, mHC and the final head (spec §2).
// The attention, MoE, MTP and state pieces live in dsv4_attn.c, dsv4_moe.c, dsv4_mtp.c and
// dsv4_state.c; this file reads top to bottom as the model does.
#include "model/dsv4.h"
#include "model/dsv41.h" // V4.1 extras and forward

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/buf.h"
#include "base/log.h"
#include "base/mem.h"
#include "base/status.h"
#include "base/hash.h"
#include "cp/cp.h" // di_cp_session_forward (context parallelism)
#include "ep/ep.h"
#include "ep/eplb.h"         // di_eplb_placement_read
#include "backend/backend.h" // di_backend (the device-resident forward)
#include "model/dsv4_dev.h"  // the device-resident forward
#include "model/dsv41_dev.h" // V4.1's
#include "model/dsv4_gguf.h"
#include "tensor/quant_ref.h"

// ---- options ----

di_model_options di_model_options_default(void) {
    di_model_options o = {
        .n_threads = 0, .precision = DI_PRECISION_FP32, .device = {.kind = DI_DEVICE_CPU}};
    return o;
}

void di_set_log_level(int level) {
    di_log_set_level(level < 0   ? DI_LOG_LEVEL_ERROR
                     : level > 3 ? DI_LOG_LEVEL_DEBUG
                                 : (di_log_level)level);
}

void di_free_buffer(void *p) {
    di_free(p);
}

void di_dsv4_round(const di_model *m, float *v, int64_t n) {
    if (m->opt.precision != DI_PRECISION_OFFICIAL) return;
    for (int64_t i = 0; i < n; i++) v[i] = di_round_bf16(v[i]);
}

// ---- load ----

static int64_t widest_row(const di_hparams *hp) {
    int64_t w = hp->n_embd;
    int64_t cand[] = {hp->q_lora_rank, (int64_t)hp->n_head * hp->head_dim / hp->o_groups,
                      (int64_t)hp->o_groups * hp->o_lora_rank, hp->expert_ff,
                      (int64_t)hp->hc_mult * hp->n_embd};
    for (size_t i = 0; i < sizeof cand / sizeof cand[0]; i++)
        if (cand[i] > w) w = cand[i];
    if (hp->v41) { // Engram wkv input, DSpark main_proj input, Markov head
        int64_t v41[] = {(int64_t)(hp->engram_max_ngram - 1) * hp->engram_n_head *
                             hp->engram_head_dim,
                         (int64_t)hp->n_dspark_target * hp->n_embd, hp->dspark_markov_rank};
        for (size_t i = 0; i < sizeof v41 / sizeof v41[0]; i++)
            if (v41[i] > w) w = v41[i];
    }
    return w;
}

// A GGUF model: `dir` itself when it names a .gguf file, else the one .gguf file in a directory
// without config.json (several are ambiguous: none is chosen). Returns the path in buf, or NULL.
static const char *find_gguf(const char *dir, char *buf, size_t cap) {
    if (di_dsv4_gguf_is_path(dir)) {
        snprintf(buf, cap, "%s", dir);
        return buf;
    }
    snprintf(buf, cap, "%s/config.json", dir);
    if (access(buf, F_OK) == 0) return NULL;
    DIR *d = opendir(dir);
    if (!d) return NULL;
    int n = 0;
    const struct dirent *de;
    while ((de = readdir(d)) != NULL)
        if (de->d_name[0] != '.' && di_dsv4_gguf_is_path(de->d_name) && n++ == 0)
            snprintf(buf, cap, "%s/%s", dir, de->d_name);
    closedir(d);
    return n == 1 ? buf : NULL;
}

// The device-resident forward on one backend per entry of devs[0, n) (owned by m: dev_backend,
// then dev_more), attached as n pipeline stages (V4 or V4.1 by the checkpoint). On failure the
// backends opened stay in m (freed with it, or by close_dev); *attaching: whether the failure was
// the attach's (every backend opened).
static di_status open_dev_on(di_model *m, const di_device *devs, int32_t n, bool *attaching) {
    *attaching = false;
    di_status st = di_backend_open(&devs[0], m->opt.n_threads, &m->dev_backend);
    for (int32_t k = 1; st == DI_OK && k < n; k++) {
        st = di_backend_open(&devs[k], m->opt.n_threads, &m->dev_more[k - 1]);
        if (st == DI_OK) m->n_dev_more = k;
    }
    if (st != DI_OK) return st;
    *attaching = true;
    di_backend *bs[DI_DEVICE_MAX_MORE + 1] = {m->dev_backend};
    for (int32_t k = 0; k < m->n_dev_more; k++) bs[k + 1] = m->dev_more[k];
    if (m->hp.v41) return di_dsv41_dev_attach_stages(m, bs, 1 + m->n_dev_more);
    return di_dsv4_dev_attach_stages(m, bs, 1 + m->n_dev_more);
}

// Destroys the device-resident forward and the backends m owns (the forward first: it frees its
// memory through them), after the device states of the sessions on it (they replay at their next
// call: "sessions on the device-resident forward").
static void close_dev(di_model *m) {
    while (m->dev_sessions) di_dsv4_session_dev_close(m->dev_sessions);
    di_dsv4_dev_destroy(m->dev);
    di_dsv41_dev_destroy(m->dev41);
    m->dev = NULL;
    m->dev41 = NULL;
    for (int32_t k = 0; k < m->n_dev_more; k++) di_backend_destroy(m->dev_more[k]);
    m->n_dev_more = 0;
    di_backend_destroy(m->dev_backend);
    m->dev_backend = NULL;
}

// --device cuda: the device-resident forward (dsv4_dev.h; V4.1: dsv41_dev.h) for sessions and the
// serving engine (engine.c, speculation included), when the model allows it (either precision
// recipe); otherwise the offloaded CPU forward. A
// device list (cuda:0,1,...): one backend per entry, the forward's pipeline stages on them
// (dsv4_dev.h / dsv41_dev.h "Pipeline stages").
static di_status open_dev(di_model *m) {
    const di_device *dv = &m->opt.device;
    di_device devs[DI_DEVICE_MAX_MORE + 1] = {{.kind = dv->kind, .index = dv->index}};
    for (int32_t k = 0; k < dv->n_more; k++)
        devs[k + 1] = (di_device){.kind = dv->kind, .index = dv->more[k]};
    bool attaching;
    di_status st = open_dev_on(m, devs, 1 + dv->n_more, &attaching);
    if (st == DI_ERR_UNSUPPORTED && attaching) { // a weight kind the backend lacks: logged
        DI_LOG_WARN("device: the device-resident forward is unavailable; sessions use the "
                    "offloaded matmuls");
        close_dev(m);
        return DI_OK;
    }
    return st;
}

di_status di_model_dev_open(di_model *m, const di_device *devs, int32_t n_devs) {
    if (m->dev || m->dev41 || m->dev_backend || n_devs < 1 || n_devs > DI_DEVICE_MAX_MORE + 1) {
        DI_LOG_ERROR("device: di_model_dev_open needs 1 to %d devices and a model without a "
                     "device-resident forward",
                     DI_DEVICE_MAX_MORE + 1);
        return DI_ERR_INVALID;
    }
    bool attaching;
    di_status st = open_dev_on(m, devs, n_devs, &attaching);
    if (st != DI_OK) close_dev(m);
    return st;
}

di_status di_model_dev_rebuild(di_model *m) {
    if (!m->dev && !m->dev41) {
        DI_LOG_ERROR("device: no device-resident forward to rebuild");
        return DI_ERR_INVALID;
    }
    if (!m->dev_backend) {
        DI_LOG_ERROR("device: the device-resident forward runs on the caller's backends: it cannot "
                     "be rebuilt here");
        return DI_ERR_UNSUPPORTED;
    }
    di_device devs[DI_DEVICE_MAX_MORE + 1];
    const int32_t n = 1 + m->n_dev_more;
    devs[0] = m->dev_backend->device;
    for (int32_t k = 0; k < m->n_dev_more; k++) devs[k + 1] = m->dev_more[k]->device;
    const int32_t n_stages =
        m->dev ? di_dsv4_dev_n_stages(m->dev) : di_dsv41_dev_n_stages(m->dev41);
    DI_LOG_WARN("device: rebuilding the %s device-resident forward (%d stages on %d backends): "
                "destroying it and its backends, resetting their devices, uploading the weights "
                "again",
                m->hp.v41 ? "V4.1" : "V4", (int)n_stages, (int)n);
    close_dev(m);
    // The offloaded matmuls' context lives on a device being reset too: closed first, reopened
    // after (its weights are uploaded again on first use).
    const bool accel = m->accel.matmul != NULL;
    if (accel) {
        di_accel_close(&m->accel);
        m->accel_matmul = NULL;
        m->accel_user = NULL;
    }
    // Every device once (stages may share one), after every backend on it is gone.
    for (int32_t k = 0; k < n; k++) {
        bool seen = false;
        for (int32_t j = 0; j < k && !seen; j++)
            seen = devs[j].kind == devs[k].kind && devs[j].index == devs[k].index;
        if (seen) continue;
        di_status st = di_backend_reset_device(&devs[k]);
        if (st != DI_OK) {
            DI_LOG_ERROR("device: resetting device %d failed (%s): no device-resident forward",
                         (int)devs[k].index, di_status_str(st));
            return st;
        }
    }
    if (accel) {
        di_status st = di_accel_open(&m->opt.device, &m->accel);
        if (st != DI_OK) {
            DI_LOG_ERROR("device: reopening the offload context failed (%s)", di_status_str(st));
            return st;
        }
        m->accel_matmul = m->accel.matmul;
        m->accel_user = m->accel.user;
    }
    bool attaching;
    di_status st = open_dev_on(m, devs, n, &attaching);
    if (st != DI_OK) {
        DI_LOG_ERROR("device: reopening the device-resident forward failed (%s)",
                     di_status_str(st));
        close_dev(m);
        return st;
    }
    DI_LOG_WARN("device: the device-resident forward is rebuilt on %s%s", m->dev_backend->desc,
                n > 1 ? " and the next stages' backends" : "");
    return DI_OK;
}

uint64_t di_dsv4_model_id(const di_model *m) {
    uint64_t h = di_fnv1a(&m->hp, sizeof m->hp, DI_FNV1A_INIT);
    h = (h ^ (uint64_t)m->opt.precision) * 0x100000001b3ull; // then one step per word
    h = (h ^ (uint64_t)m->n_params) * 0x100000001b3ull;
    h = (h ^ m->weights_id) * 0x100000001b3ull;
    return h;
}

// Attaches the expert workers named by opt.ep_workers ("HOST:PORT,HOST:PORT...").
static di_status attach_ep(di_model *m) {
    char *list = di_strdup(m->opt.ep_workers);
    const char *addr[256];
    int32_t n = 0;
    if (!list) return DI_ERR_NOMEM;
    for (char *save = NULL, *t = strtok_r(list, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n == 256) {
            DI_LOG_ERROR("ep: more than 256 expert workers");
            di_free(list);
            return DI_ERR_INVALID;
        }
        addr[n++] = t;
    }
    di_ep_placement p = {0};
    di_status st = DI_OK;
    if (m->opt.ep_placement) {
        char why[512];
        st = di_eplb_placement_read(m->opt.ep_placement, &p, why, sizeof why);
        if (st != DI_OK) DI_LOG_ERROR("ep: placement %s: %s", m->opt.ep_placement, why);
    }
    di_ep *ep = NULL;
    if (st == DI_OK) st = di_ep_attach(m, addr, n, m->opt.ep_placement ? &p : NULL, &ep);
    di_ep_placement_free(&p);
    di_free(list);
    return st;
}

// Attaches the prefill workers named by opt.cp_workers ("HOST:PORT,HOST:PORT...").
static di_status attach_cp(di_model *m) {
    char *list = di_strdup(m->opt.cp_workers);
    const char *addr[DI_CP_MAX_RANKS];
    int32_t n = 0;
    if (!list) return DI_ERR_NOMEM;
    di_status st = DI_OK;
    for (char *save = NULL, *t = strtok_r(list, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n == DI_CP_MAX_RANKS - 1) {
            DI_LOG_ERROR("cp: more than %d prefill workers", DI_CP_MAX_RANKS - 1);
            st = DI_ERR_INVALID;
            break;
        }
        addr[n++] = t;
    }
    di_cp *cp = NULL;
    if (st == DI_OK) st = di_cp_attach(m, addr, n, m->opt.cp_min_tokens, &cp);
    di_free(list);
    return st;
}

di_status di_model_load(const char *dir, const di_model_options *opt, di_model **out) {
    di_status st = DI_OK;
    di_model *m = di_calloc(1, sizeof *m);
    if (!m) return DI_ERR_NOMEM;
    m->opt = opt ? *opt : di_model_options_default();
    if (m->opt.precision != DI_PRECISION_FP32 && m->opt.precision != DI_PRECISION_OFFICIAL) {
        DI_LOG_ERROR("unknown precision %d", (int)m->opt.precision);
        st = DI_ERR_INVALID;
        goto fail;
    }
    if (m->opt.ep_workers && *m->opt.ep_workers && m->opt.device.kind != DI_DEVICE_CPU) {
        DI_LOG_ERROR("expert workers (--ep-workers) need the CPU forward: the device-resident "
                     "forward has its own MoE");
        st = DI_ERR_UNSUPPORTED;
        goto fail;
    }
    if (m->opt.ep_placement && !(m->opt.ep_workers && *m->opt.ep_workers)) {
        DI_LOG_ERROR("an expert placement (--ep-placement) needs expert workers (--ep-workers)");
        st = DI_ERR_INVALID;
        goto fail;
    }
    // The device first: a missing GPU fails before the checkpoint is mapped.
    DI_TRY(di_accel_open(&m->opt.device, &m->accel));
    m->accel_matmul = m->accel.matmul;
    m->accel_user = m->accel.user;
    char path[4096];
    const char *gguf_path = find_gguf(dir, path, sizeof path);
    if (gguf_path) {
        DI_TRY(di_dsv4_gguf_open(gguf_path, &m->gguf, &m->hp, &m->st));
    } else {
        snprintf(path, sizeof path, "%s/config.json", dir);
        DI_TRY(di_hparams_load(path, &m->hp));
    }
    DI_LOG_INFO("loading %s: %s, %d layers (+%d MTP), hidden %d, %d experts (top-%d)", dir,
                m->hp.model_type, m->hp.n_layer, m->hp.n_mtp, m->hp.n_embd, m->hp.n_expert,
                m->hp.n_expert_used);
    if (!m->st) DI_TRY(di_st_set_open_dir(dir, &m->st));
    DI_TRY(di_dsv4_weights_bind(m));
    if (m->hp.v41) DI_TRY(di_dsv41_model_init(m, dir));
    if (m->gguf) snprintf(m->layout, sizeof m->layout, "%s", "gguf");
    DI_TRY(di_pool_create(m->opt.n_threads, &m->pool));
    DI_TRY(di_cpu_init(&m->cpu, m->pool, widest_row(&m->hp)));
    int half = m->hp.rope_main.n_dims / 2;
    m->omega_main = di_malloc(sizeof(float) * (size_t)half);
    m->omega_compress = di_malloc(sizeof(float) * (size_t)half);
    if (!m->omega_main || !m->omega_compress) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    di_rope_freqs(&m->hp.rope_main, m->omega_main);
    di_rope_freqs(&m->hp.rope_compress, m->omega_compress);
    DI_LOG_INFO("loaded %s layout: %.4g M parameters (+%.4g M MTP), %.1f MiB mapped, %d threads, "
                "%s precision",
                m->layout, m->n_params / 1e6, m->n_params_mtp / 1e6,
                di_st_set_data_bytes(m->st) / 1048576.0, di_pool_n_threads(m->pool),
                m->opt.precision == DI_PRECISION_OFFICIAL ? "official" : "fp32");
    if (m->accel.matmul)
        DI_LOG_INFO("device: every matmul on %s (weights uploaded on first use, each matmul "
                    "synchronised); norms, attention, MoE routing and state on the CPU (%d "
                    "threads)",
                    m->accel.desc, di_pool_n_threads(m->pool));
    if (m->opt.device.kind == DI_DEVICE_CUDA) DI_TRY(open_dev(m));
    if (m->opt.ep_workers && *m->opt.ep_workers) {
        if ((st = attach_ep(m)) != DI_OK) goto fail;
    }
    if (m->opt.cp_workers && *m->opt.cp_workers) {
        if ((st = attach_cp(m)) != DI_OK) goto fail;
    }
    *out = m;
    return DI_OK;
fail:
    di_model_destroy(m);
    return st;
}

void di_model_destroy(di_model *m) {
    if (!m) return;
    if (m->accel.matmul) {
        di_device_stats ds;
        di_accel_get_stats(&m->accel, &ds);
        DI_LOG_INFO("device: %lld matmuls on %s (%lld declined to the CPU), %lld weights "
                    "(%.1f MiB) uploaded",
                    (long long)ds.n_matmuls, m->accel.name, (long long)ds.n_declined,
                    (long long)ds.n_weights, ds.weight_bytes / 1048576.0);
    }
    di_ep_detach(m->ep);
    di_cp_detach(m->cp);
    close_dev(m); // the forward before its backends
    di_accel_close(&m->accel);
    di_cpu_deinit(&m->cpu);
    di_pool_destroy(m->pool);
    di_dsv4_weights_free(m);
    di_dsv41_model_free(m);
    di_st_set_close(m->st);
    di_gguf_close(m->gguf); // after the set, which points into it
    di_free(m->omega_main);
    di_free(m->omega_compress);
    di_free(m);
}

di_status di_model_read_config(const char *dir, di_model_config *out) {
    if (!dir || !out) return DI_ERR_INVALID;
    di_hparams hp;
    char path[4096];
    const char *gguf_path = find_gguf(dir, path, sizeof path);
    di_status st;
    if (gguf_path) {
        di_gguf_file *f = NULL;
        st = di_gguf_open(gguf_path, &f);
        if (st == DI_OK) st = di_dsv4_gguf_hparams(f, gguf_path, &hp);
        di_gguf_close(f);
    } else {
        snprintf(path, sizeof path, "%s/config.json", dir);
        st = di_hparams_load(path, &hp);
    }
    if (st != DI_OK) return st;
    *out = (di_model_config){
        .v41 = hp.v41, .n_vocab = hp.n_vocab, .max_position_embeddings = hp.max_pos};
    return DI_OK;
}

void di_model_get_info(const di_model *m, di_model_info *out) {
    const di_hparams *hp = &m->hp;
    di_model_info i = {
        .arch = hp->model_type,
        .layout = m->layout,
        .n_vocab = hp->n_vocab,
        .n_layers = hp->n_layer,
        .n_mtp_layers = m->n_mtp_loaded,
        .hidden_size = hp->n_embd,
        .n_heads = hp->n_head,
        .head_dim = hp->head_dim,
        .n_routed_experts = hp->n_expert,
        .n_experts_per_tok = hp->n_expert_used,
        .sliding_window = hp->window,
        .bos_token_id = hp->bos_token,
        .eos_token_id = hp->eos_token,
        .n_params = m->n_params,
        .n_params_mtp = m->n_params_mtp,
        .weight_bytes = di_st_set_data_bytes(m->st),
        .n_threads = di_pool_n_threads(m->pool),
        .precision = m->opt.precision,
        .device = m->opt.device,
    };
    di_accel_get_stats(&m->accel, &i.device_stats);
    i.device_stats.resident = m->dev || m->dev41; // sessions (MTP ones too) run on it
    *out = i;
}

int32_t di_model_layer_ratio(const di_model *m, int32_t il) {
    if (il < 0 || il >= m->hp.n_layer + m->hp.n_mtp) return -1;
    return m->hp.compress_ratio[il];
}

di_status di_model_stage_split(const di_model *m, int32_t n_stages, int32_t *layer0,
                               int64_t *stage_bytes) {
    // V4.1: any cut, what crosses it handed over (dsv41_dev.h "Pipeline stages").
    if (m->hp.v41) return di_dsv41_dev_split(m, n_stages, layer0, stage_bytes);
    return di_dsv4_dev_split(m, n_stages, layer0, stage_bytes);
}

di_status di_model_stage_plan(const di_model *m, int32_t n_stages, const size_t *free_bytes,
                              di_stage_plan *stages, int64_t *n_blocks) {
    if (n_stages < 1 || n_stages > DI_DEV_SPLIT_MAX_STAGES || n_stages > m->hp.n_layer) {
        DI_LOG_ERROR("device: %d pipeline stages for %d layers (1 to min(%d, layers))", n_stages,
                     m->hp.n_layer, DI_DEV_SPLIT_MAX_STAGES);
        return DI_ERR_INVALID;
    }
    int64_t budget[DI_DEV_SPLIT_MAX_STAGES];
    const di_dev_plan p = di_dev_plan_of(m, 0); // its reserve
    for (int32_t k = 0; free_bytes && k < n_stages; k++) {
        const int64_t fr = free_bytes[k] > (size_t)INT64_MAX ? INT64_MAX : (int64_t)free_bytes[k];
        budget[k] = fr > p.reserve_bytes ? fr - p.reserve_bytes : 0;
    }
    di_dev_split_out sp;
    const di_status st = m->hp.v41
                             ? di_dsv41_dev_split_mem(m, n_stages, free_bytes ? budget : NULL, &sp)
                             : di_dsv4_dev_split_mem(m, n_stages, free_bytes ? budget : NULL, &sp);
    if (st != DI_OK) return st;
    for (int32_t k = 0; k < n_stages; k++)
        stages[k] = (di_stage_plan){.layer0 = sp.layer0[k],
                                    .layer1 = sp.layer0[k + 1],
                                    .weight_bytes = sp.cost[k].weight_bytes,
                                    .fixed_bytes = sp.cost[k].fixed_bytes,
                                    .block_bytes = sp.cost[k].block_bytes,
                                    .budget_bytes = sp.budget_bytes[k],
                                    .n_blocks = sp.blocks[k]};
    *n_blocks = sp.n_blocks;
    return DI_OK;
}

size_t di_model_describe(const di_model *m, char *buf, size_t cap) {
    const di_hparams *hp = &m->hp;
    di_buf b;
    di_buf_init(&b);
#define OUT(...) (void)di_buf_printf(&b, __VA_ARGS__)
    OUT("architecture      %s (%s layout)\n", hp->model_type, m->layout);
    OUT("parameters        %lld main + %lld MTP\n", (long long)m->n_params,
        (long long)m->n_params_mtp);
    OUT("tensor bytes      %zu\n", di_st_set_data_bytes(m->st));
    OUT("device            %s\n", m->accel.matmul ? m->accel.desc : "cpu");
    if (m->dev_backend)
        OUT("device forward    %s (sessions, MTP ones too, and the serving engine)\n",
            m->dev_backend->desc);
    const int32_t n_st = m->dev     ? di_dsv4_dev_n_stages(m->dev)
                         : m->dev41 ? di_dsv41_dev_n_stages(m->dev41)
                                    : 1;
    for (int32_t k = 0; n_st > 1 && k < n_st; k++) { // the attached split (by memory or not)
        int32_t a = 0, e = 0;
        const di_backend *sb =
            m->dev ? di_dsv4_dev_stage(m->dev, k, &a, &e) : di_dsv41_dev_stage(m->dev41, k, &a, &e);
        di_dev_stage_cost c;
        if (m->dev)
            di_dsv4_dev_stage_cost(m, a, e, &c);
        else
            di_dsv41_dev_stage_cost(m, a, e, &c);
        OUT("pipeline stage %d  layers [%d, %d)%s%s, %.1f MiB of weights, %lld bytes per entry "
            "block, %s\n",
            (int)k, (int)a, (int)e, k == 0 ? " + embedding" : "", k == n_st - 1 ? " + head" : "",
            c.weight_bytes / 1048576.0, (long long)c.block_bytes, sb->desc);
    }
    OUT("vocab             %d\n", hp->n_vocab);
    OUT("hidden            %d, %d layers, %d MTP block(s) loaded of %d declared\n", hp->n_embd,
        hp->n_layer, m->n_mtp_loaded, hp->n_mtp);
    OUT("attention         %d heads x %d (rope %d), q rank %d, %d output groups x %d, window %d\n",
        hp->n_head, hp->head_dim, hp->rope_main.n_dims, hp->q_lora_rank, hp->o_groups,
        hp->o_lora_rank, hp->window);
    OUT("indexer           %d heads x %d, top-%d\n", hp->n_index_head, hp->index_head_dim,
        hp->index_topk);
    OUT("moe               %d routed experts (top-%d) + %d shared, width %d, route scale %g, "
        "swiglu limit %g%s\n",
        hp->n_expert, hp->n_expert_used, hp->n_expert_shared, hp->expert_ff, hp->route_scale,
        hp->swiglu_limit, hp->shared_expert_clamp ? " (shared clamped)" : "");
    OUT("mhc               %d streams, %d Sinkhorn iterations, eps %g\n", hp->hc_mult, hp->hc_iters,
        hp->hc_eps);
    OUT("rope main         theta %g\n", hp->rope_main.theta);
    OUT("rope compress     theta %g%s (factor %g, L0 %lld)\n", hp->rope_compress.theta,
        hp->rope_compress.yarn ? " + YaRN" : "", hp->rope_compress.factor,
        (long long)hp->rope_compress.original_max_pos);
    if (hp->v41) {
        // V4.1: m0 = window only; m2 / m1 = CSA2 ratio; +kv = compressor owner, +idx = indexer,
        // +cand = candidate source, +eg = Engram (spec deepseek-v41.md §1.2).
        OUT("engram            %d layer(s), n-grams 2..%d, %d heads x %d\n", hp->n_engram,
            hp->engram_max_ngram, hp->engram_n_head, hp->engram_head_dim);
        OUT("dspark            %d block(s) loaded, block size %d, targets %d layers\n",
            m->n_mtp_loaded, hp->dspark_block_size, hp->n_dspark_target);
        OUT("layers           ");
        for (int il = 0; il < hp->n_layer + m->n_mtp_loaded; il++) {
            bool eg = false;
            for (int e = 0; e < hp->n_engram; e++) eg |= hp->engram_layer[e] == il;
            OUT(" %s%s%d%s%s%s%s", il == hp->n_layer ? "| dspark " : "", "m",
                hp->compress_ratio[il], il < hp->n_layer && hp->kv_source[il] ? "+kv" : "",
                il < hp->n_layer && hp->index_source[il] ? "+idx" : "",
                il == hp->candidate_layer ? "+cand" : "", eg ? "+eg" : "");
        }
        OUT("\n");
    }
    if (!hp->v41) OUT("layers           ");
    for (int il = 0; !hp->v41 && il < hp->n_layer + m->n_mtp_loaded; il++) {
        int r = hp->compress_ratio[il];
        OUT(" %s%s%s", il == hp->n_layer ? "| mtp " : "",
            r == 0   ? "SWA"
            : r == 4 ? "CSA"
                     : "HCA",
            hp->hash_routed[il] ? "/hash" : "");
    }
    if (!hp->v41) OUT("\n");
    if (m->n_params > 0) {
        const di_dsv4_layer_w *l0 = &m->layers[0];
        OUT("dtypes            embed %s, wq_a %s, experts %s\n", di_tensor_kind_name(m->embed.kind),
            di_tensor_kind_name(l0->wq_a.kind), di_tensor_kind_name(l0->w1[0].kind));
    }
#undef OUT
    size_t n = b.len;
    if (buf && cap) {
        size_t k = n < cap ? n : cap - 1;
        if (k) memcpy(buf, b.data, k);
        buf[k] = 0;
    }
    di_buf_deinit(&b);
    return n;
}

// ---- mHC (spec §2.3) ----

typedef struct hc_ctx {
    const di_model *m;
    const di_dsv4_hc_w *hc;
    const float *x;   // [T, NC, D]
    const float *mix; // [T, n_mix] raw projections (before the RMS factor)
    float *a;         // [T, D] or NULL
    float *pre;       // [T, NC] or NULL
    float *post;      // [T, NC]
    float *comb;      // [T, NC, NC]
    int32_t n_tok;
    bool head;
} hc_ctx;

void di_dsv4_hc_coeffs(const float *mix, const float *base, const float *scale, int nc, int iters,
                       float eps, float *pre, float *post, float *comb) {
    di_ref_hc_coeffs(mix, base, scale, nc, iters, eps, pre, post, comb);
}

static void hc_pre_task(void *p, int ith, int nth) {
    hc_ctx *c = p;
    const di_hparams *hp = &c->m->hp;
    const int nc = hp->hc_mult, D = hp->n_embd;
    const int n_mix = c->head ? nc : (2 + nc) * nc;
    int64_t lo, hi;
    di_split_range(c->n_tok, ith, nth, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        const float *xf = c->x + t * nc * D;
        float r =
            1.0f / sqrtf(di_ref_dot(xf, xf, (int64_t)nc * D) / (float)(nc * D) + hp->norm_eps);
        float mix[16 * 18];
        for (int i = 0; i < n_mix; i++) mix[i] = c->mix[t * n_mix + i] * r;
        float pre[16];
        di_dsv4_hc_coeffs(mix, c->hc->base, c->hc->scale, nc, hp->hc_iters, hp->hc_eps, pre,
                          c->head ? NULL : c->post + t * nc,
                          c->head ? NULL : c->comb + t * nc * nc);
        if (c->pre)
            for (int s = 0; s < nc; s++) c->pre[t * nc + s] = pre[s];
        if (!c->a) continue;
        float *a = c->a + t * D;
        for (int d = 0; d < D; d++) {
            float acc = 0;
            for (int s = 0; s < nc; s++) acc += pre[s] * xf[s * D + d];
            a[d] = acc;
        }
    }
}

void di_dsv4_hc_mix(di_dsv4_ctx *cx, const di_dsv4_hc_w *hc, const float *x, int32_t n_tok,
                    float *pre, float *a, bool head) {
    di_model *m = cx->model;
    const di_hparams *hp = &m->hp;
    int nc = hp->hc_mult;
    int n_mix = head ? nc : (2 + nc) * nc;
    float *mix = di_dsv4_scratch(cx, DI_SCR_MIX);
    // mix_raw = fn . xf  [T, n_mix] (FP32 weights, FP32 input)
    di_dsv4_matmul(m, &hc->fn, x, n_tok, (int64_t)nc * hp->n_embd, mix, n_mix);
    hc_ctx c = {m,
                hc,
                x,
                mix,
                a,
                pre,
                di_dsv4_scratch(cx, DI_SCR_POST),
                di_dsv4_scratch(cx, DI_SCR_COMB),
                n_tok,
                head};
    di_pool_run(m->pool, hc_pre_task, &c);
    if (a) di_dsv4_round(m, a, (int64_t)n_tok * hp->n_embd); // R-OFF: collapsed input is BF16
}

// (a, post, comb) = hc_pre(X); with head = true only `a` (spec §2.9).
static void hc_pre(di_dsv4_ctx *cx, const di_dsv4_hc_w *hc, const float *x, int32_t n_tok, float *a,
                   bool head) {
    di_dsv4_hc_mix(cx, hc, x, n_tok, NULL, a, head);
}

// X'[t, k] = post_k * o[t] + sum_j C[j][k] * X[t, j]
void di_dsv4_hc_post(di_dsv4_ctx *c, const float *o, float *x, int32_t n_tok) {
    const di_model *m = c->model;
    const int nc = m->hp.hc_mult, D = m->hp.n_embd;
    const float *post = di_dsv4_scratch(c, DI_SCR_POST), *comb = di_dsv4_scratch(c, DI_SCR_COMB);
    di_ref_hc_post(o, x, post, comb, nc, D, n_tok);
    di_dsv4_round(m, x, (int64_t)n_tok * nc * D); // R-OFF: residual streams are BF16
}

// ---- decoder block (spec §2.2) ----

void di_dsv4_block(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, int il_state, float *x,
                   const int32_t *ids) {
    const di_model *m = c->model;
    const di_hparams *hp = &m->hp;
    const int64_t D = hp->n_embd;
    const int32_t n_tok = c->n_rows;
    float *a = di_dsv4_scratch(c, DI_SCR_A);   // [T, D]
    float *o = di_dsv4_scratch(c, DI_SCR_OUT); // [T, D]

    hc_pre(c, &lw->hc_attn, x, n_tok, a, false);
    di_ref_rmsnorm(a, n_tok, D, D, lw->attn_norm, hp->norm_eps);
    di_dsv4_round(m, a, n_tok * D);
    // Context parallelism: the state of the earlier pieces comes in before the attention reads it
    // and this piece's goes out right after (the rest of the block is per row). A failure stops
    // the block before the attention touches a state that was not installed.
    if (c->cp && (c->status = c->cp->attn(c->cp->user, c, il_state, false)) != DI_OK) return;
    di_dsv4_attention(c, lw, il_state, a, o);
    if (c->cp && (c->status = c->cp->attn(c->cp->user, c, il_state, true)) != DI_OK) return;
    if (c->trace) c->trace(c->trace_user, "attn_out", lw->il, o, false, n_tok, D);
    di_dsv4_hc_post(c, o, x, n_tok);

    hc_pre(c, &lw->hc_ffn, x, n_tok, a, false);
    di_ref_rmsnorm(a, n_tok, D, D, lw->ffn_norm, hp->norm_eps);
    di_dsv4_round(m, a, n_tok * D);
    di_dsv4_moe(c, lw, a, ids, o);
    if (c->trace) c->trace(c->trace_user, "ffn_out", lw->il, o, false, n_tok, D);
    di_dsv4_hc_post(c, o, x, n_tok);
}

void di_dsv4_hc_head(di_dsv4_ctx *c, const di_dsv4_hc_w *hc, const float *norm, const float *x,
                     int32_t n_tok, float *h) {
    const di_model *m = c->model;
    hc_pre(c, hc, x, n_tok, h, true);
    di_ref_rmsnorm(h, n_tok, m->hp.n_embd, m->hp.n_embd, norm, m->hp.norm_eps);
    di_dsv4_round(m, h, (int64_t)n_tok * m->hp.n_embd);
}

// ---- the forward pass of one call ----

void di_dsv4_set_rows(di_dsv4_ctx *c) {
    di_dsv4_ws *ws = c->ws;
    int32_t n_rows = 0;
    for (int32_t i = 0; i < c->n_seq; i++) {
        di_dsv4_seq *sq = &c->seqs[i];
        DI_ASSERT(sq->n_tok >= 1);
        sq->row0 = n_rows;
        for (int32_t t = 0; t < sq->n_tok; t++) {
            ws->row_seq[n_rows + t] = i;
            ws->row_pos[n_rows + t] = sq->pos + t;
        }
        n_rows += sq->n_tok;
    }
    DI_ASSERT(n_rows <= ws->scratch_tokens);
    c->n_rows = n_rows;
}

di_status di_dsv4_forward_batch(di_dsv4_ctx *c, const int32_t *tokens, const int32_t *logit_rows,
                                int32_t n_logit_rows, float *logits) {
    di_model *m = c->model;
    const di_hparams *hp = &m->hp;
    const int nc = hp->hc_mult;
    const int64_t D = hp->n_embd;

    di_dsv4_set_rows(c); // sequence after sequence; each row knows its sequence and position
    const int32_t n_rows = c->n_rows;
    m->n_forward_calls++;
    float *x = di_dsv4_scratch(c, DI_SCR_X); // [T, NC, D]

    // Embedding, copied into every stream (§2.1).
    for (int32_t t = 0; t < n_rows; t++) {
        float *xt = x + (int64_t)t * nc * D;
        di_tensor_row_f32(&m->embed, tokens[t], xt);
        for (int k = 1; k < nc; k++) memcpy(xt + k * D, xt, sizeof(float) * (size_t)D);
    }
    for (int il = 0; il < hp->n_layer && c->status == DI_OK; il++) {
        di_dsv4_block(c, &m->layers[il], il, x, tokens);
        if (c->trace) c->trace(c->trace_user, "layer_out", il, x, false, n_rows, nc * D);
    }

    if (c->status == DI_OK && logits && n_logit_rows > 0)
        di_dsv4_head_rows(c, logit_rows, n_logit_rows, logits);
    return c->status;
}

void di_dsv4_head_rows(di_dsv4_ctx *c, const int32_t *logit_rows, int32_t n_logit_rows,
                       float *logits) {
    di_model *m = c->model;
    const di_hparams *hp = &m->hp;
    const int nc = hp->hc_mult;
    const int64_t D = hp->n_embd;
    float *x = di_dsv4_scratch(c, DI_SCR_X); // [T, NC, D]
    // Final head (§2.9) on the requested rows, gathered in place to the front of X (rows are
    // ascending, so each copy moves a row down or leaves it; X is not read again after this).
    const size_t row = sizeof(float) * (size_t)(nc * D);
    bool contiguous = true;
    for (int32_t k = 0; k < n_logit_rows; k++) {
        DI_ASSERT(logit_rows[k] >= k && logit_rows[k] < c->n_rows);
        contiguous &= logit_rows[k] == logit_rows[0] + k;
    }
    const float *xh = x + (int64_t)logit_rows[0] * nc * D;
    if (!contiguous) {
        for (int32_t k = 0; k < n_logit_rows; k++)
            if (logit_rows[k] != k)
                memmove(x + (int64_t)k * nc * D, x + (int64_t)logit_rows[k] * nc * D, row);
        xh = x;
    }
    float *h = di_dsv4_scratch(c, DI_SCR_H);
    di_dsv4_hc_head(c, &m->hc_head, m->norm, xh, n_logit_rows, h);
    di_dsv4_matmul(m, &m->head, h, n_logit_rows, D, logits, hp->n_vocab);
}

// ---- sessions on the device-resident forward ----
//
// A session on a device-resident forward (V4: s->dev, dsv4_dev.h; V4.1: s->dev41, dsv41_dev.h)
// runs slot 0 of its own 1-slot state, made at create (V4) or at its first call (V4.1), and keeps
// the tokens it fed on the host (dev_tokens). A V4.1 DSpark session (mtp) runs there too: its
// state is made with DSpark on (di_dsv41_dev_dspark_enable, the DSpark rings written by every
// call), di_session_draft drafts on it (di_dsv41_dev_draft) and di_session_rollback takes back
// up to DI_DSV41_ROLLBACK_MAX positions (di_dsv41_dev_rollback; s->pos, and so dev_tokens, shorten
// with it); a replay (device loss, a token state restored) rebuilds the DSpark rings with the
// layers'. A V4 session's state takes back up to DI_DSV4_ROLLBACK_MAX rows, as the CPU session
// (di_dsv4_dev_state_create_spec back_max; dsv4_dev.h "Rollback": its rings that many rows longer,
// the bound counted from the highest position fed; the session checks its own count first, s->hw,
// as the CPU session does: the same refusals). A V4 MTP session runs there too: its state has the
// MTP ring and kept streams (the MTP block uploaded at its first state, di_dsv4_dev_mtp_enable: any
// time, the model's other states keeping none); the CPU session's MTP position waits for the next
// call's first token, so each call (each chunk of dev_max_rows) at p runs the MTP block on the
// pending position p - 1 first, from its kept main streams (the device's MTP call reads only the
// last main call's rows otherwise, and the main call's own kept rows may overwrite p - 1's), then
// the main call, then the MTP block on that call's rows but the last (dev_feed); the MTP logits are
// the CPU session's rows bit for bit. Its rollback takes the MTP ring back with the main one, to
// one below (di_dsv4_dev_rollback_mtp, both checked first), and a replay rebuilds it with the
// layers'. Device loss (deepinfer.h di_session_forward; the serving engine's counterpart is
// engine.c "device loss"): a call that finds DI_ERR_DEVICE_LOST drops the device state of every
// session of the model (they are listed on it: the states live on the forward being destroyed),
// rebuilds the forward (di_model_dev_rebuild: every device reset, the weights uploaded again), and
// runs again: a new state, the session's positions [0, p0) replayed from dev_tokens without logits,
// then the call itself from p0. The device forward is deterministic and feeding the same tokens in
// any chunking gives the same state, so the logits after the recovery are the ones of a run that
// never lost the device. The other sessions replay theirs at their next call (dev_on with no
// state). At most loss_max losses found by this session's calls within loss_window_s seconds are
// recovered; past that (or when the rebuild fails) the call returns DI_ERR_DEVICE_LOST and the
// session keeps its tokens and position. The session owns the recovery (not generate, nor a caller
// of the API): it alone holds the tokens and the device state, and it meets every loss, whoever
// calls it; the bound is per session, as a loss is found by one call.

bool di_dsv4_session_on_dev(const di_session *s) {
    return s->dev_on || (s->v41 && s->model->dev41 && s->pos == 0);
}

di_status di_dsv4_session_dev_open(di_session *s) {
    di_model *m = s->model;
    if (s->v41 ? !m->dev41 : !m->dev) {
        DI_LOG_ERROR("session: the model's device-resident forward is gone (its rebuild after a "
                     "device loss failed)");
        return DI_ERR_DEVICE_LOST;
    }
    if (!s->dev_rows) {
        s->dev_max_rows =
            s->n_ctx_max < DI_DSV4_DEV_SESSION_ROWS ? s->n_ctx_max : DI_DSV4_DEV_SESSION_ROWS;
        // A draft call's block rows are rows of the state's calls too.
        if (s->v41 && s->mtp && s->dev_max_rows < m->hp.dspark_block_size)
            s->dev_max_rows = m->hp.dspark_block_size;
        s->dev_rows = di_malloc(sizeof(int32_t) * (size_t)s->dev_max_rows);
        if (!s->dev_rows) return DI_ERR_NOMEM;
    }
    if (!s->dev_tokens) {
        s->dev_tokens = di_malloc(sizeof(int32_t) * (size_t)s->n_ctx_max);
        if (!s->dev_tokens) return DI_ERR_NOMEM;
    }
    if (!s->v41 && s->mtp && !s->dev_mtp) {
        s->dev_mtp = di_malloc(sizeof(int32_t) * 3 * (size_t)s->dev_max_rows);
        if (!s->dev_mtp) return DI_ERR_NOMEM;
    }
    // V4: rollbacks of up to DI_DSV4_ROLLBACK_MAX rows, as the CPU session's; an MTP session's
    // state with the MTP ring and the kept streams its pending position reads (the block uploaded
    // first: a no-op once done, again after a rebuild).
    const di_dsv4_dev_spec spec = {
        .mtp = s->mtp, .keep_streams = s->mtp, .back_max = DI_DSV4_ROLLBACK_MAX};
    di_status st = DI_OK;
    if (!s->v41 && s->mtp) st = di_dsv4_dev_mtp_enable(m->dev);
    if (st != DI_OK) return st;
    st = s->v41 ? di_dsv41_dev_state_create(m->dev41, 1, s->n_ctx_max, s->dev_max_rows, 0, 0,
                                            &s->dev41)
                : di_dsv4_dev_state_create_spec(m->dev, 1, s->n_ctx_max, s->dev_max_rows, 0, 0,
                                                &spec, &s->dev);
    // A DSpark session (mtp on V4.1): its state writes the DSpark rings and drafts (before the
    // slot holds a position, as di_dsv41_dev_dspark_enable requires).
    if (st == DI_OK && s->v41 && s->mtp && (st = di_dsv41_dev_dspark_enable(s->dev41)) != DI_OK) {
        di_dsv41_dev_state_destroy(s->dev41);
        s->dev41 = NULL;
    }
    if (st != DI_OK) return st;
    s->dev_on = true;
    s->dev_next = m->dev_sessions;
    m->dev_sessions = s;
    return DI_OK;
}

void di_dsv4_session_dev_close(di_session *s) {
    if (!s->dev && !s->dev41) return;
    for (di_session **p = &s->model->dev_sessions; *p; p = &(*p)->dev_next) {
        if (*p == s) {
            *p = s->dev_next;
            break;
        }
    }
    s->dev_next = NULL;
    di_dsv4_dev_state_destroy(s->dev);
    di_dsv41_dev_state_destroy(s->dev41);
    s->dev = NULL;
    s->dev41 = NULL;
}

// A V4 MTP session's MTP call on rows of its device state (di_dsv4_session_forward's MTP on the
// device), positions mp.. : the pending position alone (kept: its main streams kept by the call
// that fed it, read before the next main call writes its own kept rows over them; with the token
// fed after it, ids[0]), or rows 0 .. n - 1 of the main call just made (each with the token after
// it). Their MTP logits to logits (NULL: none) [n, V].
static di_status dev_mtp(di_session *s, int32_t mp, bool kept, const int32_t *ids, int32_t n,
                         float *logits) {
    int32_t *xr = s->dev_mtp, *in = xr + s->dev_max_rows, *lr = in + s->dev_max_rows;
    for (int32_t t = 0; t < n; t++) {
        xr[t] = kept ? DI_DSV4_DEV_X_KEPT : t;
        in[t] = ids[t];
        lr[t] = t;
    }
    di_dsv4_dev_seq ms = {.slot = 0, .pos = mp, .n_tok = n};
    return di_dsv4_dev_mtp_forward(s->dev, &ms, 1, xr, in, lr, logits ? n : 0, logits);
}

// Feeds tokens at s->pos on the session's device state, in chunks of at most dev_max_rows rows
// (validated by the caller), recording them in dev_tokens. A V4 MTP session's chunk at p runs the
// MTP block on the pending position p - 1 (p > 0) with its first token before its main call, and
// on its rows but the last after it (dev_mtp): its MTP ring then waits at p + n - 1, as the CPU
// session's; the MTP logits go to their row of the feed's (positions max(p0 - 1, 0) .. for a
// feed from p0). A failure leaves s->pos where the failed chunk started (the caller decides).
static di_status dev_feed(di_session *s, const int32_t *tokens, int32_t n_tok,
                          const di_forward_out *out) {
    const int64_t V = s->model->hp.n_vocab;
    const bool want = out && out->logits;
    const int32_t m0 = s->pos > 0 ? s->pos - 1 : 0; // the feed's first MTP position
    for (int32_t done = 0; done < n_tok;) {
        const int32_t n = n_tok - done < s->dev_max_rows ? n_tok - done : s->dev_max_rows;
        const bool last = done + n == n_tok;
        int32_t n_rows = 0;
        float *logits = NULL;
        if (want && !out->last_only) {
            for (int32_t t = 0; t < n; t++) s->dev_rows[n_rows++] = t;
            logits = out->logits + done * V;
        } else if (want && last) {
            s->dev_rows[n_rows++] = n - 1;
            logits = out->logits;
        }
        di_status st;
        if (s->v41) {
            di_dsv41_dev_seq seq = {.slot = 0, .pos = s->pos, .n_tok = n};
            st =
                di_dsv41_dev_forward(s->dev41, &seq, 1, tokens + done, s->dev_rows, n_rows, logits);
        } else {
            // The MTP rows' logits: row q - m0 of the feed's for position q.
            float *ml = out && out->mtp_logits ? out->mtp_logits - m0 * V : NULL;
            st = DI_OK;
            if (s->mtp && s->pos > 0)
                st = dev_mtp(s, s->pos - 1, true, tokens + done, 1, ml ? ml + (s->pos - 1) * V : 0);
            di_dsv4_dev_seq seq = {.slot = 0, .pos = s->pos, .n_tok = n};
            if (st == DI_OK)
                st = di_dsv4_dev_forward(s->dev, &seq, 1, tokens + done, s->dev_rows, n_rows,
                                         logits);
            if (st == DI_OK && s->mtp && n > 1)
                st = dev_mtp(s, s->pos, false, tokens + done + 1, n - 1,
                             ml ? ml + s->pos * V : NULL);
        }
        if (st != DI_OK) return st;
        // A replay feeds dev_tokens itself: the same place, so memmove.
        memmove(s->dev_tokens + s->pos, tokens + done, sizeof(int32_t) * (size_t)n);
        s->pos += n;
        done += n;
    }
    return DI_OK;
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

// A call found the device lost: drops every device state of the model's sessions and rebuilds the
// forward, within the bound. DI_OK: run the call again (its session replays first).
static di_status dev_lost(di_session *s) {
    di_model *m = s->model;
    const int64_t now = now_ms(), ring = (int64_t)s->loss_max + 1;
    s->loss_ms[s->stats.n_device_losses % ring] = now;
    s->stats.n_device_losses++;
    int64_t n_recent = 0; // losses within the window, this one included (at most ring)
    for (int64_t k = 0; k < ring && k < s->stats.n_device_losses; k++)
        n_recent += now - s->loss_ms[k] < (int64_t)s->loss_window_s * 1000;
    int32_t n_dropped = 0;
    while (m->dev_sessions) { // their states live on the forward about to be destroyed
        di_dsv4_session_dev_close(m->dev_sessions);
        n_dropped++;
    }
    if (n_recent == ring) { // more than loss_max within the window
        DI_LOG_ERROR("session: the device was lost %d times within %d s (device_loss_max %d): "
                     "not rebuilding it again",
                     (int)ring, (int)s->loss_window_s, (int)s->loss_max);
        return DI_ERR_DEVICE_LOST;
    }
    if (!m->dev && !m->dev41) {
        DI_LOG_ERROR("session: the device is lost and the model has no device-resident forward "
                     "to rebuild");
        return DI_ERR_DEVICE_LOST;
    }
    DI_LOG_WARN("session: the device is lost (loss %lld of this session, %lld within %d s): "
                "rebuilding the device-resident forward (%d session states dropped); the session "
                "replays its %d tokens",
                (long long)s->stats.n_device_losses, (long long)n_recent, (int)s->loss_window_s,
                (int)n_dropped, (int)s->pos);
    di_status st = di_model_dev_rebuild(m);
    if (st != DI_OK) {
        DI_LOG_ERROR("session: rebuilding the device-resident forward failed (%s)",
                     di_status_str(st));
        return DI_ERR_DEVICE_LOST;
    }
    s->stats.n_device_recoveries++;
    return DI_OK;
}

// A device session whose state was dropped (a device loss, this session's or another's): a new
// state, positions [0, s->pos) replayed from dev_tokens. On failure s->pos is kept.
static di_status dev_revive(di_session *s) {
    const int32_t pos = s->pos;
    di_status st = di_dsv4_session_dev_open(s);
    if (st != DI_OK) return st;
    s->pos = 0;
    st = dev_feed(s, s->dev_tokens, pos, NULL);
    if (st == DI_OK && pos > 0) {
        s->stats.n_replayed_tokens += pos;
        DI_LOG_INFO("session: %d tokens replayed into a new device state", (int)pos);
    }
    s->pos = pos;
    return st;
}

// The session's call on the device-resident forward, with the device-loss recovery above.
static di_status dev_forward(di_session *s, const int32_t *tokens, int32_t n_tok,
                             const di_forward_out *out) {
    if (!s->dev_on) { // V4.1: the state is made at the first call
        if (s->pos != 0) {
            DI_LOG_ERROR("forward: this V4.1 session ran on the CPU forward (batched calls); it "
                         "cannot move to the device-resident forward");
            return DI_ERR_INVALID;
        }
        di_status st = di_dsv4_session_dev_open(s);
        if (st != DI_OK) return st;
    }
    const int32_t p0 = s->pos;
    for (;;) {
        di_status st = DI_OK;
        if (s->lose_in > 0) {
            s->lose_in--;
            DI_LOG_WARN("session: DI_SESSION_LOSE_DEVICE: this call fails with %s without running "
                        "(a drill)",
                        di_status_str(DI_ERR_DEVICE_LOST));
            st = DI_ERR_DEVICE_LOST;
        }
        if (st == DI_OK && !s->dev && !s->dev41) st = dev_revive(s);
        if (st == DI_OK) st = dev_feed(s, tokens, n_tok, out);
        if (st == DI_OK) break;
        if (st != DI_ERR_DEVICE_LOST) {
            // The device state of this call is incomplete: start again (its state kept, at 0).
            s->pos = 0;
            return st;
        }
        s->pos = p0; // this call's chunks done so far are fed again
        if ((st = dev_lost(s)) != DI_OK) return st;
    }
    // V4 MTP: the rows of positions max(p0 - 1, 0) .. p0 + n_tok - 2 (deepinfer.h).
    if (out && out->n_mtp_out) *out->n_mtp_out = s->mtp && !s->v41 ? (p0 > 0) + n_tok - 1 : 0;
    if (s->pos > s->hw) s->hw = s->pos; // as the CPU session's (di_dsv4_rollback)
    return DI_OK;
}

// A device session's rollback: the slot's positions taken back on its state (host bookkeeping:
// V4.1 di_dsv41_dev_rollback; V4 di_dsv4_dev_rollback, an MTP session's MTP ring with it to one
// below, where the CPU session's waits, di_dsv4_dev_rollback_mtp; back to 0 the next call starts
// the slot afresh), or, when the state was dropped (another session's device loss), only s->pos:
// the replay at the next call feeds dev_tokens [0, s->pos). The device refuses a rollback its
// rings cannot take back (past DI_DSV4_ROLLBACK_MAX rows below the highest position fed, e.g.
// after successive rollbacks; dsv4_dev.h "Rollback"): nothing changes then. The session's own
// bound was checked first (di_session_rollback_begin, its only caller).
di_status di_dsv4_session_dev_rollback(di_session *s, int32_t n) {
    if (n == 0) return DI_OK;
    const int32_t pos = s->pos - n;
    di_status st = DI_OK;
    if (s->dev41)
        st = di_dsv41_dev_rollback(s->dev41, 0, n);
    else if (s->dev && pos > 0)
        st = s->mtp ? di_dsv4_dev_rollback_mtp(s->dev, 0, pos, pos - 1)
                    : di_dsv4_dev_rollback(s->dev, 0, pos);
    if (st != DI_OK) return st;
    s->pos = pos;
    return DI_OK;
}

// A DSpark draft on the session's device state (di_dsv41_dev_draft: the CPU draft's drafts,
// confidences and logits bit for bit), with the device-loss recovery of dev_forward: a dropped
// state is replayed first, a loss found by the draft rebuilds the forward and drafts again.
di_status di_dsv4_session_dev_draft(di_session *s, int32_t anchor, di_dsv41_draft *out,
                                    float *logits) {
    if (anchor < 0 || anchor >= s->model->hp.n_vocab || s->pos < 1) {
        DI_LOG_ERROR("dspark: needs a committed forward and an anchor token id < %d",
                     s->model->hp.n_vocab);
        return DI_ERR_INVALID;
    }
    for (;;) {
        di_status st = s->dev41 ? DI_OK : dev_revive(s);
        if (st == DI_OK) {
            di_dsv41_dev_draft_seq d = {.slot = 0, .anchor = anchor};
            st = di_dsv41_dev_draft(s->dev41, &d, 1, logits);
            if (st == DI_OK) *out = d.out;
        }
        if (st != DI_ERR_DEVICE_LOST) return st;
        if ((st = dev_lost(s)) != DI_OK) return st;
    }
}

void di_session_get_stats(const di_session *s, di_session_stats *out) {
    *out = s->stats;
}

di_status di_session_forward(di_session *s, const int32_t *tokens, int32_t n_tok,
                             const di_forward_out *out) {
    di_model *m = s->model;
    const di_hparams *hp = &m->hp;
    if (n_tok < 1 || !tokens) {
        DI_LOG_ERROR("forward: need at least one token");
        return DI_ERR_INVALID;
    }
    if ((int64_t)s->pos + n_tok > s->n_ctx_max) {
        DI_LOG_ERROR("forward: %d + %d tokens exceed the session's context of %d", s->pos, n_tok,
                     s->n_ctx_max);
        return DI_ERR_INVALID;
    }
    for (int32_t t = 0; t < n_tok; t++) {
        if (tokens[t] < 0 || tokens[t] >= hp->n_vocab) {
            DI_LOG_ERROR("forward: token id %d at index %d is outside the vocabulary [0, %d)",
                         tokens[t], t, hp->n_vocab);
            return DI_ERR_INVALID;
        }
    }
    if (s->lose_in > 0 && !di_dsv4_session_on_dev(s)) { // the drill on the CPU forward
        s->lose_in--;
        DI_LOG_ERROR("session: DI_SESSION_LOSE_DEVICE: this call fails with %s (a drill); the "
                     "session runs on the CPU forward: there is no device state to rebuild",
                     di_status_str(DI_ERR_DEVICE_LOST));
        return DI_ERR_DEVICE_LOST;
    }
    if (s->v41 && (s->dev_on || m->dev41)) return dev_forward(s, tokens, n_tok, out);
    if (s->v41 && m->cp && n_tok >= di_cp_min_tokens(m->cp)) // context parallelism (cp/cp.h)
        return di_cp_session_forward(m->cp, s, tokens, n_tok, out);
    if (s->v41) { // DeepSeek V4.1 (dsv41.c): the batch of one sequence
        bool want = out && out->logits;
        di_dsv41_seq b = {.s = s,
                          .tokens = tokens,
                          .n_tok = n_tok,
                          .n_out = want ? (out->last_only ? 1 : n_tok) : 0};
        di_status st = di_dsv41_forward_batch(m, di_dsv41_ws(s), &b, 1, want ? out->logits : NULL);
        if (st != DI_OK) return st;
        if (out && out->n_mtp_out) *out->n_mtp_out = 0;
        return DI_OK;
    }
    if (s->dev_on) return dev_forward(s, tokens, n_tok, out);
    if (m->cp && n_tok >= di_cp_min_tokens(m->cp)) // context parallelism (cp/cp.h)
        return di_cp_session_forward(m->cp, s, tokens, n_tok, out);
    return di_dsv4_session_forward(s, tokens, n_tok, out, NULL);
}

di_status di_dsv4_session_forward(di_session *s, const int32_t *tokens, int32_t n_tok,
                                  const di_forward_out *out, const di_dsv4_cp_hook *cp) {
    di_model *m = s->model;
    const di_hparams *hp = &m->hp;
    di_status st = di_dsv4_session_reserve(s, n_tok);
    if (st != DI_OK) return st;

    const int32_t p0 = s->pos;
    const int nc = hp->hc_mult;
    const int64_t D = hp->n_embd;
    di_dsv4_seq seq = {.layers = s->layers, .pos = p0, .n_tok = n_tok};
    di_dsv4_ctx c = {.model = m,
                     .ws = &s->ws,
                     .seqs = &seq,
                     .n_seq = 1,
                     .trace = s->trace,
                     .trace_user = s->trace_user,
                     .cp = cp};
    float *x = di_dsv4_scratch(&c, DI_SCR_X); // [T, NC, D]
    // The head reads X in place (its rows are contiguous), so X survives for the MTP block.
    st = di_dsv4_forward_batch(&c, tokens, NULL, 0, NULL);
    if (st != DI_OK) return st;
    if (out && out->logits) {
        int32_t first = out->last_only ? n_tok - 1 : 0;
        float *h = di_dsv4_scratch(&c, DI_SCR_H);
        di_dsv4_hc_head(&c, &m->hc_head, m->norm, x + (int64_t)first * nc * D, n_tok - first, h);
        di_dsv4_matmul(m, &m->head, h, n_tok - first, D, out->logits, hp->n_vocab);
    }

    // MTP (§2.10): position p needs the token at p + 1, so this call completes positions
    // p0 - 1 (pending from the previous call) .. p0 + T - 2; the last position waits. Main streams
    // of the last positions stay in mtp_x (slot = position mod ROLLBACK_MAX + 1): the pending one
    // is there after a rollback too.
    if (s->mtp) {
        const int32_t xr = DI_DSV4_ROLLBACK_MAX + 1;
        // Context parallelism: this piece's last main row goes on, the previous piece's comes in
        // as the pending position p0 - 1.
        if (cp && cp->mtp_input &&
            (st = cp->mtp_input(cp->user, s, x + (int64_t)(n_tok - 1) * nc * D)) != DI_OK)
            return st;
        float *xm = di_dsv4_scratch(&c, DI_SCR_XMAIN);
        int32_t n = 0, p_first = s->mtp_pending ? p0 - 1 : p0;
        size_t row = sizeof(float) * (size_t)(nc * D);
        if (s->mtp_pending) memcpy(xm, s->mtp_x + (int64_t)((p0 - 1) % xr) * nc * D, row), n = 1;
        memcpy(xm + (int64_t)n * nc * D, x, row * (size_t)(n_tok - 1));
        for (int32_t t = n_tok > xr ? n_tok - xr : 0; t < n_tok; t++)
            memcpy(s->mtp_x + (int64_t)((p0 + t) % xr) * nc * D, x + (int64_t)t * nc * D, row);
        n += n_tok - 1;
        const int32_t *ids_next = s->mtp_pending ? tokens : tokens + 1;
        if (n > 0) {
            di_dsv4_seq ms = {.layers = s->layers, .pos = p_first, .n_tok = n};
            di_dsv4_ctx mc = c;
            mc.seqs = &ms;
            di_dsv4_set_rows(&mc);
            float *ml = out ? out->mtp_logits : NULL;
            st = di_dsv4_mtp_forward_batch(&mc, xm, ids_next, NULL, ml ? n : 0, ml);
            if (st != DI_OK) return st;
        }
        s->mtp_pending = true;
        if (out && out->n_mtp_out) *out->n_mtp_out = n;
    } else if (out && out->n_mtp_out) {
        *out->n_mtp_out = 0;
    }
    s->pos = p0 + n_tok;
    if (s->pos > s->hw) s->hw = s->pos;
    return DI_OK;
}
