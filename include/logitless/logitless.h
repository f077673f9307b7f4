// logitless: fused LLM training-loss kernels. The umbrella header.
#pragma once

#include "logitless/cross_entropy.h"
#include "logitless/error.h"
#include "logitless/glu.h"
#include "logitless/linear_cross_entropy.h"
#include "logitless/linear_policy_loss.h"
#include "logitless/policy_loss.h"
#include "logitless/rms_norm.h"
#include "logitless/rope.h"
#include "logitless/tensor.h"
#include "logitless/version.h"
#include "logitless/vocab_parallel.h"
