// tools/cli/args.c's shared model options on their own (no model, no device): --precision parsed
// and remembered as given, and di_args_model_finish's default recipe: fp32 on the CPU, official
// with a CUDA device unless --precision said otherwise (the device itself is set directly: a
// build without the CUDA backend refuses --device cuda at parse).
#include "harness.h"

#include "cli/args.h"

static di_model_args parse(int argc, char **argv) {
    di_model_args ma = {.opt = di_model_options_default()};
    for (int i = 0; i < argc; i++) CHECK_EQ(di_args_model_option(argc, argv, &i, &ma), 1);
    return ma;
}

static void test_precision_default(void) {
    // The CPU: fp32 whatever was given or not.
    di_model_args ma = parse(0, NULL);
    CHECK(!ma.precision_given);
    di_args_model_finish(&ma);
    CHECK_EQ(ma.opt.precision, DI_PRECISION_FP32);
    char *official[] = {"--precision", "official"};
    ma = parse(2, official);
    CHECK(ma.precision_given);
    di_args_model_finish(&ma);
    CHECK_EQ(ma.opt.precision, DI_PRECISION_OFFICIAL);
    // A CUDA device: official without --precision, what --precision says with it.
    ma = parse(0, NULL);
    ma.opt.device.kind = DI_DEVICE_CUDA;
    di_args_model_finish(&ma);
    CHECK_EQ(ma.opt.precision, DI_PRECISION_OFFICIAL);
    char *fp32[] = {"--precision", "fp32"};
    ma = parse(2, fp32);
    ma.opt.device.kind = DI_DEVICE_CUDA;
    di_args_model_finish(&ma);
    CHECK_EQ(ma.opt.precision, DI_PRECISION_FP32);
    // A bad value: refused, nothing remembered as given but the attempt.
    char *bad[] = {"--precision", "fp16"};
    di_model_args mb = {.opt = di_model_options_default()};
    int i = 0;
    CHECK_EQ(di_args_model_option(2, bad, &i, &mb), -1);
    CHECK_EQ(mb.opt.precision, DI_PRECISION_FP32);
}

int main(void) {
    RUN(test_precision_default);
    return test_finish();
}
